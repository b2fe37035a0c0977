"""Parameters moved into one huge-page mapping keep their values and their sharing."""

import mmap

import pytest
import torch
from torch import nn

from compile_runtime.cpu.hugepages import HUGE_PAGE, move_into_hugepages

pytestmark = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE"), reason="madvise(MADV_HUGEPAGE) is Linux only"
)


def test_moved_parameters_keep_their_values_in_one_mapping():
    params = [
        nn.Parameter(torch.randint(0, 255, s, dtype=torch.uint8), requires_grad=False)
        for s in [(7, 3, 34), (5, 20), (1,)]
    ]
    params.append(nn.Parameter(torch.randn(4, 4), requires_grad=False))
    before = [p.detach().clone() for p in params]
    old = [p.data_ptr() for p in params]
    moved = move_into_hugepages(params + [params[0]])  # a parameter named twice moves once
    assert moved == sum(-(-p.numel() * p.element_size() // 64) * 64 for p in params)
    ptrs = [p.data_ptr() for p in params]
    assert all(a != b for a, b in zip(old, ptrs, strict=True))
    assert ptrs[0] % HUGE_PAGE == 0 and all(p % 64 == 0 for p in ptrs)
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < moved  # one mapping, in order
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b) and p.dtype == b.dtype and p.is_contiguous()
    params[1].add_(1)  # still ordinary writable memory
    assert torch.equal(params[1], before[1] + 1)


def test_a_view_or_a_shared_storage_is_left_where_it_is():
    base = torch.zeros(8, 16)
    view = nn.Parameter(base[2:4], requires_grad=False)
    assert move_into_hugepages([view]) == 0
    view.fill_(1)
    assert base[2:4].eq(1).all()  # the view still writes into its base
