"""Tensor-parallel layers and sharded loading, checked in one process.

Each rank's layers are built here by setting the parallel state by hand (no
process group): their partial results, summed or concatenated as the
collective would, must equal the single-rank layer, and the loader must give
each rank exactly its slice of the checkpoint. Multi-process runs are in
tests/test_executor.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import compile_runtime.distributed.linear as linear_mod
import compile_runtime.distributed.parallel_state as ps
import compile_runtime.distributed.vocab as vocab_mod
from compile_runtime.distributed import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallelConfigError,
    VocabParallelEmbedding,
    check_tensor_parallel,
    head_layout,
)
from compile_runtime.models.loader import iterate_checkpoint
from compile_runtime.models.registry import load_model


@pytest.fixture
def as_rank(monkeypatch):
    """Build layers as ``rank`` of ``world`` (collectives replaced by identity: partials)."""
    monkeypatch.setattr(linear_mod, "tensor_parallel_all_reduce", lambda x: x)
    monkeypatch.setattr(vocab_mod, "tensor_parallel_all_reduce", lambda x: x)
    monkeypatch.setattr(vocab_mod, "gather_to_first_rank", lambda x, dim=-1: x)

    def set_rank(rank: int, world: int) -> None:
        monkeypatch.setattr(ps, "_state", ps.ParallelState(rank, world, "gloo", None, "0"))

    yield set_rank


def test_head_layout_splits_or_replicates_kv_heads():
    # 8 query heads, 2 KV heads over 4 ranks: 2 query heads each, each KV head on 2 ranks.
    layouts = [head_layout(8, 2, r, 4) for r in range(4)]
    assert [(lay.num_heads, lay.num_kv_heads) for lay in layouts] == [(2, 1)] * 4
    assert [lay.q_head_start for lay in layouts] == [0, 2, 4, 6]
    assert [lay.kv_head_start for lay in layouts] == [0, 0, 1, 1]
    # Query head q uses KV head q // (8 // 2): each rank's KV head serves its query heads.
    for lay in layouts:
        assert lay.q_head_start // 4 == lay.kv_head_start
    split = head_layout(8, 4, 1, 2)
    assert (split.num_heads, split.num_kv_heads, split.kv_head_start, split.kv_replicas) == (
        4,
        2,
        2,
        1,
    )


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ({}, 3, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
        ({"num_key_value_heads": 4, "num_attention_heads": 8}, 8, None),
        (
            {"num_key_value_heads": 3, "num_attention_heads": 6},
            6,
            "intermediate_size=128 is not divisible by tensor_parallel_size=6",
        ),
        (
            {"num_key_value_heads": 3, "num_attention_heads": 12},
            4,
            "num_key_value_heads=3 is fewer than tensor_parallel_size=4",
        ),
    ],
)
def test_start_up_check_names_the_numbers(overrides, world, message):
    config = SimpleNamespace(
        intermediate_size=128,
        num_attention_heads=overrides.get("num_attention_heads", 4),
        num_key_value_heads=overrides.get("num_key_value_heads", 2),
    )
    if message is None:
        check_tensor_parallel(config, world)
    else:
        with pytest.raises(TensorParallelConfigError, match=message):
            check_tensor_parallel(config, world)


def test_single_rank_layers_are_plain_linear_and_embedding():
    torch.manual_seed(0)
    x = torch.randn(7, 32)
    ids = torch.randint(0, 50, (7,))
    qkv = QKVParallelLinear(32, 8, 4, 2, bias=True)
    row = RowParallelLinear(32, 16, bias=True, name="o_proj")
    emb = VocabParallelEmbedding(50, 32)
    head = ParallelLMHead(50, 32)
    assert torch.equal(qkv(x), F.linear(x, qkv.weight, qkv.bias))
    assert torch.equal(row(x), F.linear(x, row.weight, row.bias))
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))
    assert torch.equal(head.compute_logits(x), F.linear(x, head.weight))
    assert qkv.weight.shape == (32 + 2 * 16, 32) and emb.weight.shape == (50, 32)


def test_partials_of_two_ranks_add_up_to_one_rank(as_rank):
    torch.manual_seed(0)
    x = torch.randn(5, 24)
    full_gate_up = torch.randn(2 * 40, 24)
    full_down = torch.randn(24, 40)
    full_embed = torch.randn(51, 24)  # 51 rows: the last rank's slice is padded
    ids = torch.tensor([0, 25, 26, 50, 13])

    mlp_out, embeds, logits = [], [], []
    for rank in range(2):
        as_rank(rank, 2)
        gate_up = MergedColumnParallelLinear(24, [40, 40], bias=False, name="gate_up_proj")
        down = RowParallelLinear(40, 24, bias=False, name="down_proj")
        emb = VocabParallelEmbedding(51, 24)
        head = ParallelLMHead(51, 24)
        with torch.no_grad():
            half = slice(rank * 20, rank * 20 + 20)
            gate_up.weight.copy_(
                torch.cat([full_gate_up[:40][half], full_gate_up[40:][half]], dim=0)
            )
            down.weight.copy_(full_down[:, half])
            rows = full_embed[emb.start : emb.end]
            emb.weight[: len(rows)].copy_(rows)
            head.weight.copy_(emb.weight)
        g, u = gate_up(x).chunk(2, dim=-1)
        mlp_out.append(down(F.silu(g) * u))
        embeds.append(emb(ids))
        logits.append(head.compute_logits(x))
    g, u = F.linear(x, full_gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(sum(mlp_out), F.linear(F.silu(g) * u, full_down))
    assert torch.equal(sum(embeds), F.embedding(ids, full_embed))
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :51], F.linear(x, full_embed))


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_loads_only_its_slice(model_dirs, as_rank, world):
    """Concatenating every rank's parameters gives back the checkpoint (KV heads replicated at 4)."""
    import compile_runtime as cr

    model_dir = model_dirs("qwen2")  # q/k/v biases too
    config = cr.CompilationConfig(mode="NONE")
    full = load_model(model_dir, config)
    ranks = []
    for rank in range(world):
        as_rank(rank, world)
        ranks.append(load_model(model_dir, config))
    attn = [m.model.layers[1].self_attn for m in ranks]
    ref = full.model.layers[1].self_attn
    q_size, kv_size = ref.q_size, ref.kv_size
    for name in ("weight", "bias"):
        fused = [getattr(a.qkv_proj, name) for a in attn]
        q = torch.cat([f[: a.q_size] for f, a in zip(fused, attn, strict=True)])
        assert torch.equal(q, getattr(ref.qkv_proj, name)[:q_size])
        k_parts = [f[a.q_size : a.q_size + a.kv_size] for f, a in zip(fused, attn, strict=True)]
        replicas = attn[0].qkv_proj.layout.kv_replicas
        k = torch.cat(k_parts[::replicas])
        assert torch.equal(k, getattr(ref.qkv_proj, name)[q_size : q_size + kv_size])
        if replicas > 1:
            assert torch.equal(k_parts[0], k_parts[1])
    o = torch.cat([a.o_proj.weight for a in attn], dim=1)
    assert torch.equal(o, ref.o_proj.weight)
    assert torch.equal(torch.cat([m.lm_head.weight for m in ranks]), full.lm_head.weight)
    emb = torch.cat([m.model.embed_tokens.weight for m in ranks])
    assert torch.equal(emb, full.model.embed_tokens.weight)


def test_checkpoint_slices_read_only_the_rows_asked_for(tmp_path):
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    save_file({"w": t}, str(tmp_path / "model.safetensors"))
    ((name, tensor),) = list(iterate_checkpoint(str(tmp_path)))
    assert name == "w" and tensor.shape == (4, 6)
    assert torch.equal(tensor.narrow(0, 1, 2), t[1:3])
    assert torch.equal(tensor.narrow(1, 4, 2), t[:, 4:6])
    with pytest.raises(ValueError, match=r"needs \[3, 5\) along dim 0"):
        tensor.narrow(0, 3, 2)
