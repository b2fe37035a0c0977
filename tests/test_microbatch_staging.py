"""Micro-batching: the second half's metadata is built only once the first half's
host-to-device copies (which read the same pinned staging buffers) are done."""

from __future__ import annotations

import numpy as np
import torch

from compile_runtime.worker import microbatch
from compile_runtime.worker.step_inputs import StepBuffers, StepInputs


class FakeEvent:
    """The platform's step event, logging when it is recorded and waited on."""

    def __init__(self, log: list[str]):
        self.log = log

    def record(self, stream=None) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")


def decode_step(n: int) -> StepInputs:
    ones = np.ones(n, dtype=np.int64)
    cu = np.cumsum(ones)
    return StepInputs(
        req_ids=[f"r{i}" for i in range(n)],
        rows=np.arange(n),
        num_scheduled=ones,
        num_computed=np.full(n, 4, dtype=np.int64),
        cu_num_scheduled=cu,
        token_ids=np.arange(n, dtype=np.int64) + 3,
        positions=np.full(n, 4, dtype=np.int64),
        slot_mapping=torch.arange(n, dtype=torch.long),
        total=n,
        seq_lens=np.full(n, 5, dtype=np.int64),
        block_table=torch.zeros(n, 2, dtype=torch.int32),
        query_start_loc=torch.from_numpy(np.concatenate([[0], cu]).astype(np.int32)),
    )


def run(monkeypatch, copied: FakeEvent | None, log: list[str]) -> torch.Tensor:
    def fake_build_metadata(groups, qsl, seq_lens, block_table, slots, n, **kw):
        log.append(f"build {n}")
        return None

    monkeypatch.setattr(microbatch, "build_metadata", fake_build_metadata)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)  # the fake's
    buffers = StepBuffers(8, torch.device("cpu"))
    buffers._copied = copied
    step = decode_step(4)
    buffers.load(step, step.total)
    log.clear()

    def model(ids, positions):
        log.append(f"forward {len(ids)}")
        return ids.float()[:, None].repeat(1, 2)

    return microbatch.run_microbatches(
        step, 2, [], model=model, buffers=buffers, groups=(), lora=None
    )


def test_second_half_waits_for_the_first_halfs_copies(monkeypatch):
    log: list[str] = []
    out = run(monkeypatch, FakeEvent(log), log)
    assert log == [
        "build 2",
        "record",  # forward_args: after the first half's copies
        "forward 2",
        "synchronize",  # before the second half writes the staging buffers again
        "build 2",
        "record",
        "forward 2",
    ]
    assert out[:, 0].tolist() == [3.0, 4.0, 5.0, 6.0]


def test_no_event_on_a_cpu_is_a_no_op(monkeypatch):
    log: list[str] = []
    out = run(monkeypatch, None, log)
    assert log == ["build 2", "forward 2", "build 2", "forward 2"]
    assert out.shape == (4, 2)
