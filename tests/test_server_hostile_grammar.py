"""Output constraints' grammars compiled in a child process that is killed at the time
bound: a grammar too slow to compile is a 400 naming the field and ``--max-prepare-seconds``,
its process is gone (the CPU is free again), a fresh one takes its place, and a constraint
that compiled once skips the child the next time."""

from __future__ import annotations

import asyncio
import os
import time
import types

import pytest

pytest.importorskip("xgrammar")

from compile_runtime.core.sampling_params import StructuredOutputsParams
from compile_runtime.server import grammar_process
from compile_runtime.server.api_error import APIError
from compile_runtime.server.grammar_process import GrammarProcesses, tokenizer_info_json


def wide_schema(n: int, prefix: str = "p") -> StructuredOutputsParams:
    props = {f"{prefix}{i}": {"type": "string"} for i in range(n)}
    return StructuredOutputsParams(json={"type": "object", "properties": props})


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running either
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture(scope="module")
def manager(model_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs("llama"))
    return types.SimpleNamespace(tokenizer=tok, vocab_size=512, stop_token_ids=[tok.eos_token_id])


def test_a_slow_grammar_is_killed_at_the_bound(manager):
    async def run():
        g = GrammarProcesses(lambda: tokenizer_info_json(manager), processes=1)
        try:
            await g.check(StructuredOutputsParams(regex="a+b"), "guided_regex", 30)
            assert g.known == 1 and len(g._children) == 1
            (first,) = g._children
            start = time.monotonic()
            with pytest.raises(APIError) as slow:  # 5000 properties: seconds to compile
                await g.check(wide_schema(5000), "response_format", 0.3)
            assert time.monotonic() - start < 5
            assert slow.value.status == 400 and slow.value.param == "response_format"
            assert "--max-prepare-seconds" in slow.value.message
            for _ in range(50):
                if not alive(first.pid):
                    break
                await asyncio.sleep(0.02)
            assert not alive(first.pid)
            assert g.known == 1  # the slow one is not remembered
            # A fresh child answers the next request; one that compiled once skips it.
            await g.check(StructuredOutputsParams(grammar='root ::= "a" | "b"'), "x", 60)
            assert g.known == 2 and first not in g._children and len(g._children) == 1
            await g.check(StructuredOutputsParams(regex="a+b"), "guided_regex", 0.0001)
            await g.check(StructuredOutputsParams(json_object=True), "response_format", 0.0001)
            assert g.known == 2
        finally:
            await g.close()

    asyncio.run(run())


def test_children_are_bounded_and_so_is_what_they_remember(manager, monkeypatch):
    monkeypatch.setattr(grammar_process, "KNOWN", 3)

    async def run():
        g = GrammarProcesses(lambda: tokenizer_info_json(manager), processes=1)
        try:
            await g.check(StructuredOutputsParams(regex="a"), "x", 60)  # the child is up
            busy = asyncio.ensure_future(g.check(wide_schema(5000, "q"), "a", 1))
            await asyncio.sleep(0.1)
            with pytest.raises(APIError) as waited:  # the one child is busy past the bound
                await g.check(StructuredOutputsParams(regex="b"), "b", 0.2)
            assert waited.value.status == 503
            with pytest.raises(APIError):
                await busy
            for i in range(5):
                await g.check(StructuredOutputsParams(regex=f"c{i}"), "x", 60)
            assert g.known == 3
        finally:
            await g.close()

    asyncio.run(run())
