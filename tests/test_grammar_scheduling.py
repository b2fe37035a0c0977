"""A request whose grammar is still compiling is passed over, not waited for: the requests
queued behind it start, and it starts once its grammar is ready (vLLM's rule); with nothing
else to run, the scheduler waits for it."""

from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer

from compile_runtime.core.request import Request
from compile_runtime.core.sampling_params import SamplingParams, StructuredOutputsParams
from compile_runtime.core.scheduler import Scheduler
from compile_runtime.core.structured_output import StructuredOutputManager


class SlowGrammars(StructuredOutputManager):
    """Grammars that compile only once ``release`` is set."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, vocab_size=len(tokenizer), stop_token_ids=(2,))
        self.release = threading.Event()

    def _compile(self, params):
        self.release.wait(timeout=30)
        return super()._compile(params)


@pytest.fixture
def grammars(model_dirs):
    return SlowGrammars(AutoTokenizer.from_pretrained(model_dirs("llama")))


def request(req_id: str, constrained: bool) -> Request:
    so = StructuredOutputsParams(regex="[0-9]") if constrained else None
    return Request(req_id, [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=so))


def started(out) -> list[str]:
    return [r.req_id for r in out.scheduled_new_reqs]


def test_a_compiling_grammar_lets_the_requests_behind_it_start(grammars):
    s = Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  structured_outputs=grammars)  # fmt: skip
    s.add_request(request("free-before", False))
    assert started(s.schedule()) == ["free-before"]
    s.add_request(request("constrained", True))
    s.add_request(request("free-after", False))
    out = s.schedule()
    assert started(out) == ["free-after"]  # passed over, still first in the queue
    assert [r.req_id for r in s.waiting] == ["constrained"]
    grammars.release.set()
    grammars._compiling["constrained"].result(timeout=30)
    assert started(s.schedule()) == ["constrained"]


def test_with_nothing_else_to_run_it_waits_for_the_grammar(grammars):
    s = Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                  structured_outputs=grammars)  # fmt: skip
    s.add_request(request("constrained", True))
    threading.Timer(0.2, grammars.release.set).start()
    assert started(s.schedule()) == ["constrained"]


def test_the_compiled_grammars_kept_are_bounded(model_dirs, monkeypatch):
    """Every distinct constraint a client sends is compiled and kept for reuse, up to
    ``GRAMMAR_CACHE_BYTES``: past it the least recently used go."""
    from compile_runtime.core import structured_output

    tokenizer = AutoTokenizer.from_pretrained(model_dirs("llama"))

    def cache_bytes_after_12_constraints() -> int:
        manager = StructuredOutputManager(tokenizer, len(tokenizer), stop_token_ids=(2,))
        for n in range(12):
            manager.compile_ahead(StructuredOutputsParams(regex=f"[0-9]{{{n + 1}}}x"))
        return manager._compiler.get_cache_size_bytes()

    kept = cache_bytes_after_12_constraints()
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_BYTES", 1)
    assert 0 < cache_bytes_after_12_constraints() < kept / 4, kept
