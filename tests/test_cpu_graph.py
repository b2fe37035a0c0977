"""CPU graphs: decode steps captured once per size and replayed from C, equal to the bit.

Inductor pieces (the point: their kernels are what a CPU graph records) on the tiny Llama,
against the same engine with ``cudagraph_mode="NONE"`` (today's path: every step through
Python). Counts, never times.
"""

from __future__ import annotations

import pytest
import torch

import compile_runtime as cr
from compile_runtime.attention.metadata import MetadataError
from compile_runtime.counters import compilation_counter
from compile_runtime.cpu import graph as cpu_graph
from compile_runtime.cpu import linear as cpu_linear
from compile_runtime.cpu.attention import CPUBatchedMetadataBuilder
from compile_runtime.cpu.graph import cpu_graphs_available
from compile_runtime.cpu.graph_pool import CPUGraphPool
from compile_runtime.cpu.quant_gemm import kernel_available
from compile_runtime.graphs.wrapper import CUDAGraphWrapper

pytestmark = pytest.mark.skipif(not cpu_graphs_available(), reason="needs a C compiler")

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [30, 31]]


def _engine(
    model_dir: str, mode: str | None, dtype: str = "float32", lazy: bool = False, **options
) -> cr.LLM:
    """Graphs captured at start-up (what most tests here count), or on first use (``lazy``)."""
    options.setdefault("quantization", "none")
    config = {"backend": "inductor", "compile_sizes": [], "lazy_capture": lazy}
    if mode is not None:
        config["cudagraph_mode"] = mode
    return cr.LLM(
        model_dir,
        config,
        dtype=dtype,
        max_num_seqs=4,
        max_model_len=128,
        kv_cache_bytes=16 * 2**20,
        **options,
    )


def _tokens(llm: cr.LLM, prompts, n: int = 12) -> list[list[int]]:
    params = cr.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _full_wrapper(llm: cr.LLM) -> CUDAGraphWrapper:
    """The FULL graphs of decode batches (they run on through the LM head)."""
    forward = llm.executor.driver_runner.cudagraph_plan.decode_model
    assert isinstance(forward, CUDAGraphWrapper)
    return forward


@pytest.fixture(scope="module")
def reference(model_dirs):
    """Greedy tokens of today's path (no graphs), per dtype and quantization."""
    cache: dict = {}

    def get(dtype: str, quantization: str = "none", prompts=None):
        prompts = prompts or PROMPTS
        key = (dtype, quantization, str(prompts))
        if key not in cache:
            llm = _engine(model_dirs("llama"), "NONE", dtype, quantization=quantization)
            assert llm.executor.driver_runner.capture_report is None
            cache[key] = _tokens(llm, prompts)
            llm.shutdown()
        return cache[key]

    return get


QUANTIZATIONS = ["none"] + (["int8"] if kernel_available() else [])


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_steps_equal_the_unreplayed_ones(model_dirs, reference, dtype, quantization):
    llm = _engine(model_dirs("llama"), None, dtype, quantization=quantization)
    runner = llm.executor.driver_runner
    report = runner.capture_report
    assert report.kind == "CPU" and not report.failed, report.summary()
    assert sorted(report.sizes["FULL"]) == [1, 2, 4]  # decode sizes up to max_num_seqs
    assert len(report.sizes["PIECEWISE"]) == 11  # mixed sizes up to 64
    full = _full_wrapper(llm)
    # Four requests, then three and fewer as they finish at different lengths (padded to 4
    # and 2): every decode step replays, and padding rows never reach the real ones.
    for prompts in (PROMPTS, PROMPTS[:3], PROMPTS[:1]):
        before = full.num_replays
        assert _tokens(llm, prompts) == reference(dtype, quantization, prompts)
        assert full.num_replays - before == 11  # 12 tokens: one prefill, 11 decode steps


def test_graphs_captured_on_first_use_equal_those_of_start_up(model_dirs, reference):
    """The default on a CPU: nothing captured at start-up; a size's first step runs
    unreplayed, its second is captured, the rest replay; the tokens do not change."""
    with compilation_counter.expect(num_cudagraph_captured=0):
        llm = _engine(model_dirs("llama"), None, lazy=None)
    runner = llm.executor.driver_runner
    assert runner.capture_report.on_first_use and not runner.capture_report.sizes
    assert "captured on first use" in llm.startup.summary()
    full = _full_wrapper(llm)
    assert _tokens(llm, PROMPTS[:1]) == reference("float32", "none", PROMPTS[:1])
    # 12 tokens: a prefill, then 11 decode steps of one token: warm-up, capture, 9 replays.
    assert full.num_replays == 9 and runner.capture_report.sizes["FULL"] == [1]
    assert runner.unreplayed[runner.lazy_capture.FIRST_USE] == 2  # the prefill's size too
    with compilation_counter.expect(num_backend_compilations=0):  # the prefill's size captured
        assert _tokens(llm, PROMPTS[:1]) == reference("float32", "none", PROMPTS[:1])
    with compilation_counter.expect(num_cudagraph_captured=0, num_backend_compilations=0):
        assert _tokens(llm, PROMPTS[:1]) == reference("float32", "none", PROMPTS[:1])
    assert full.num_replays == 9 + 11 + 11
    assert _tokens(llm, PROMPTS) == reference("float32")  # batches of 4, 2 and 1 decoding
    assert (
        set(runner.capture_report.sizes["FULL"]) <= {1, 2, 4} and not runner.capture_report.failed
    )


def test_batch_one_generation_replays_every_decode_step_and_compiles_nothing(model_dirs):
    llm = _engine(model_dirs("llama"), None)
    full = _full_wrapper(llm)
    before = full.num_replays
    with compilation_counter.expect(num_backend_compilations=0, num_cudagraph_captured=0):
        _tokens(llm, [PROMPTS[0]], n=100)
    assert full.num_replays - before == 99


def test_mixed_steps_replay_their_pieces(model_dirs, reference):
    """Prompts prefilled in chunks of 8 next to decodes: mixed steps, in PIECEWISE graphs."""
    llm = _engine(model_dirs("llama"), None, max_num_batched_tokens=8)
    runner = llm.executor.driver_runner
    assert sorted(runner.capture_report.sizes["PIECEWISE"])[:3] == [1, 2, 4]
    params = cr.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    steps = []
    original = runner.execute_model

    def spy(so):
        original(so)
        steps.append(runner.execute_state.runtime_mode)

    runner.execute_model = spy
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference("float32")
    assert "PIECEWISE" in steps and "FULL" in steps and "NONE" not in steps


def test_a_refused_capture_falls_back_for_that_size_and_names_the_op(
    model_dirs, reference, monkeypatch
):
    """One size's capture meets an op with no native entry: that size runs as today."""
    bodies = dict(cpu_graph._op_bodies())
    linear = bodies["compile_runtime::cpu_linear"]

    def linear_with_a_copy(x, weight, bias):
        out = linear(x, weight, bias)
        return out.clone() if x.shape[0] == 2 else out  # a torch op: nothing to replay

    bodies["compile_runtime::cpu_linear"] = linear_with_a_copy
    monkeypatch.setattr(cpu_graph, "_op_bodies", lambda: bodies)
    llm = _engine(model_dirs("llama"), None)
    runner = llm.executor.driver_runner
    report = runner.capture_report
    assert {key for key in report.failed if "num_tokens=2," in key} == {
        "PIECEWISE BatchDescriptor(num_tokens=2, num_reqs=None, uniform=False, has_lora=False)",
        "FULL BatchDescriptor(num_tokens=2, num_reqs=2, uniform=True, has_lora=False)",
    }
    assert all("aten.clone" in why for key, why in report.failed.items() if "=2," in key)
    assert "aten.clone" in report.summary()
    assert 2 not in report.sizes["FULL"] and 4 in report.sizes["FULL"]
    # Two requests decode in the size-4 graph now (the dispatcher dropped size 2).
    assert _tokens(llm, PROMPTS[:2]) == reference("float32", "none", PROMPTS[:2])
    assert runner.dispatcher.dispatch(2, True)[1].num_tokens == 4


def test_steps_above_the_largest_size_run_unreplayed_with_a_reason(model_dirs, reference):
    llm = cr.LLM(
        model_dirs("llama"),
        {"backend": "inductor", "compile_sizes": [], "cudagraph_capture_sizes": [1, 2]},
        max_num_seqs=4,
        max_model_len=128,
        kv_cache_bytes=16 * 2**20,
    )
    runner = llm.executor.driver_runner
    assert _tokens(llm, PROMPTS) == reference("float32")
    assert runner.unreplayed["above the largest captured size"] > 0


def test_out_of_range_blocks_are_an_error_before_any_replay():
    builder = CPUBatchedMetadataBuilder(spec=None, block_size=16, max_num_reqs=4, device="cpu")
    builder.num_cache_blocks = 8
    table = torch.tensor([[3, 9]], dtype=torch.int32)  # block 9 of a cache of 8
    with pytest.raises(MetadataError, match="blocks 3..9"):
        builder.build(
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([20], dtype=torch.int32),
            table,
            torch.tensor([19 + 16 * 8], dtype=torch.int64),
            1,
            for_cudagraph=True,
        )


def test_token_ids_outside_the_vocabulary_are_an_error_not_a_replay(model_dirs):
    llm = _engine(model_dirs("llama"), None)
    vocab = llm.executor.driver_runner.vocab_size
    with pytest.raises(Exception, match="vocabulary|out of range|token id"):
        _tokens(llm, [[5, vocab + 3]])


def test_float_arguments_are_refused_when_a_native_function_is_declared():
    import ctypes

    from compile_runtime.cpu.native_function import NativeFunction

    libc = ctypes.CDLL(None)
    with pytest.raises(TypeError, match="floating point"):
        NativeFunction(libc, "sqrt", [ctypes.c_double])


def test_graph_memory_is_what_the_capture_allocated(model_dirs):
    llm = _engine(model_dirs("llama"), None)
    report = llm.executor.driver_runner.capture_report
    weights = sum(
        p.numel() * p.element_size() for p in llm.executor.driver_runner.model.parameters()
    )
    assert 0 < report.memory_bytes < weights + 64 * 2**20


def test_graph_memory_is_shared_between_sizes_never_within_one():
    """As a CUDA graph pool: one storage holds at most one buffer of each step (mode and
    descriptor), the smallest that fits; it goes when the graphs holding it do."""
    pool = CPUGraphPool()
    big, small = ("FULL", 8), ("FULL", 4)
    a = pool.share(torch.empty(8, 64), big)
    b = pool.share(torch.empty(8, 32), big)
    c = pool.share(torch.empty(4, 32), small)  # fits on b's storage: the smallest that holds it
    d = pool.share(torch.empty(4, 32), small)  # not b's again (same step): on a's
    e = pool.share(torch.empty(4, 32), small)  # nothing left for this step: its own
    ptr = [t.untyped_storage().data_ptr() for t in (a, b, c, d, e)]
    assert ptr[2] == ptr[1] and ptr[3] == ptr[0] and ptr[4] not in ptr[:2]
    assert pool.nbytes == (8 * 64 + 8 * 32 + 4 * 32) * 4
    del a, d
    assert pool.nbytes == (8 * 32 + 4 * 32) * 4  # a's storage went with its graphs


def test_a_matmul_replays_through_a_callback_and_follows_its_inputs():
    a, b = torch.randn(3, 5), torch.randn(5, 4)
    graph = cpu_graph.CPUGraph()
    with torch.inference_mode():
        out = graph.capture(lambda: torch.mm(a, b), None)
        a.copy_(torch.randn(3, 5))  # new values at the same address: what a step does
        graph.replay()
    assert torch.equal(out, torch.mm(a, b)) and len(graph.callbacks) == 1


@pytest.mark.parametrize("kernel", ["gemv", "onednn", "linear"])
def test_every_linear_kernel_the_tuning_may_choose_replays(model_dirs, monkeypatch, kernel):
    """A tuned table may give any row bucket any kernel (compile_runtime/cpu/kernel_tuning.py): each one is
    captured (native call or callback into torch), at every size, with the tokens of the
    same kernel run unreplayed."""
    if kernel == "gemv" and torch.float32 not in cpu_linear.gemv_dtypes():
        pytest.skip("no float32 GEMV on this CPU")
    monkeypatch.setattr(cpu_linear, "built_in_kernel", lambda entry, dtype, rows: kernel)
    unreplayed = _engine(model_dirs("llama"), "NONE")
    expected = _tokens(unreplayed, PROMPTS)
    unreplayed.shutdown()
    llm = _engine(model_dirs("llama"), None)
    report = llm.executor.driver_runner.capture_report
    assert not report.failed, report.summary()
    assert _tokens(llm, PROMPTS) == expected
    llm.shutdown()


def test_a_dry_capture_records_native_calls_without_running_them():
    """Start-up's captures are dry (their steps are dummies): the first replay computes."""
    import ctypes

    from compile_runtime.cpu.native_function import NativeFunction

    argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    memset = NativeFunction(ctypes.CDLL(None), "memset", argtypes, ctypes.c_void_p)
    buf = torch.zeros(16, dtype=torch.uint8)
    graph = cpu_graph.CPUGraph()
    with cpu_graph.dry_captures():
        graph.capture(lambda: memset(buf.data_ptr(), 7, 16), None)
    assert buf.tolist() == [0] * 16 and len(graph.calls) == 1  # recorded, not run
    graph.replay()
    assert buf.tolist() == [7] * 16
    graph = cpu_graph.CPUGraph()
    graph.capture(lambda: memset(buf.data_ptr(), 3, 16), None)  # not dry: runs as it records
    assert buf.tolist() == [3] * 16


def test_an_op_that_computes_in_torch_refuses_capture_by_name():
    a = torch.randn(4)
    with pytest.raises(cpu_graph.GraphCaptureUnsupported, match=r"aten\.add"):
        cpu_graph.CPUGraph().capture(lambda: a + 1, None)


def test_speculative_verify_steps_replay_full_graphs_of_1_plus_k_tokens(model_dirs, tmp_path):
    """Speculative decoding's uniform batches (1 + k tokens a request) get FULL CPU graphs: the
    copier (tests/copier.py) drafts k tokens every step, so its decode steps replay them,
    two requests at once too, with the tokens of the unreplayed engine and of the copy."""
    from copier import copy_prompt, make_copier_dir, orbit

    model_dir, f = make_copier_dir(model_dirs("llama"), str(tmp_path / "copier"))
    k = 2
    spec = {"method": "ngram", "num_speculative_tokens": k}
    prompts = [copy_prompt(f), copy_prompt(f)[1:]]
    params = cr.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for mode in ("NONE", None):
        llm = _engine(model_dir, mode, speculative_config=spec)
        if mode is None:
            forward = _full_wrapper(llm)
            full = llm.executor.driver_runner.capture_report.sizes["FULL"]
            assert {1 + k, 2 * (1 + k)} <= set(full)
            before = forward.num_replays
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs[mode] = [list(o.outputs[0].token_ids) for o in outs]
        if mode is None:
            uniform_steps = llm.workload.decode[1 + k] + llm.workload.decode[2 * (1 + k)]
            assert uniform_steps >= 5
            assert forward.num_replays - before == uniform_steps
        llm.shutdown()
    assert outputs[None] == outputs["NONE"]
    assert outputs[None] == [orbit(f, f[p[-1]], 24) for p in prompts]
