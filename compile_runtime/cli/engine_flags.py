"""The engine flags ``compile-runtime generate`` and ``serve`` share, and the ``LLM`` they
describe."""

from __future__ import annotations

import argparse

from compile_runtime.cli.argtypes import device, float_in, positive_int, positive_int_list
from compile_runtime.config import parse_config
from compile_runtime.models.dtype import DTYPE_CHOICES


def add_engine_arguments(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    """What builds the engine (``_engine``), shared by ``generate`` and ``serve`` (whose model
    may come positionally instead, as ``vllm serve MODEL``: ``model_required=False``)."""
    p.add_argument(
        "--model",
        required=model_required,
        help="model directory (config.json + safetensors) or a .gguf file",
    )
    p.add_argument("-O", "--compilation-config", default=None, help="CompilationConfig as JSON")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPE_CHOICES),
        help="auto: the checkpoint's where this machine runs it well (bf16 on a CPU with "
        "AVX512-BF16/AMX for 16-bit and quantized checkpoints), else float32",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "gguf", "none", "int8"],
        help="auto: a GGUF file's Q8_0/Q4_0/Q4_1 weights kept quantized on a CPU, else none; "
        "none: dequantize; int8: quantize a float checkpoint's linear weights (per 32)",
    )
    p.add_argument(
        "--device", type=device, default=None, help="cpu, cuda or cuda:N (default: cuda if any)"
    )
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=None, help="requests per step (default 256)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="tokens per step (default 2048)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="prompt + output tokens per request (default: the model's positions, capped by "
        "what the KV cache holds)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=positive_int,
        default=None,
        help="CPU: bytes of KV cache (default: --kv-cache-memory-fraction of the available RAM)",
    )
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float_in(0.0, 0.9, low_open=True),
        default=None,
        help="CPU: fraction of the available RAM for the KV cache (default 0.2)",
    )
    p.add_argument("--use-transformers", action="store_true", help="run through the adapter")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1)
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=positive_int,
        default=1,
        help="stages the layers are split into, each on --tensor-parallel-size ranks (default 1)",
    )
    p.add_argument(
        "--pipeline-layer-partition",
        type=positive_int_list,
        default=None,
        help="layers per stage, e.g. 16,14 (default: an even split)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=1,
        help="engines, each a whole copy of the model in its own worker processes, sharing "
        "the requests (default 1)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=["uni", "mp", "ray"],
        default=None,
        help="where the model runs: uni (this process), mp (worker processes), ray (default: "
        "uni on one rank, mp on several; serve on a CPU: mp)",
    )
    p.add_argument(
        "--num-threads",
        type=positive_int,
        default=None,
        help="CPU threads (default: the free cores)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    p.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (PEFT directories)"
    )
    p.add_argument(
        "--max-loras", type=positive_int, default=None, help="adapters in one step (default 1)"
    )
    p.add_argument(
        "--max-lora-rank", type=positive_int, default=None, help="largest rank (default 16)"
    )
    p.add_argument(
        "--max-cpu-loras",
        type=positive_int,
        default=None,
        help="adapters kept read in memory (default: --max-loras)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of prompt prefixes seen before (default: on)",
    )


def engine_from_args(args: argparse.Namespace):
    """The ``LLM`` the engine arguments describe (``add_engine_arguments``)."""
    from compile_runtime.engine.llm import LLM

    # Sizes the user left out stay unset: the engine picks them for the model and machine.
    sizes = {
        name: getattr(args, name)
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "kv_cache_bytes",
            "kv_cache_memory_fraction",
            "max_loras",
            "max_lora_rank",
            "max_cpu_loras",
        )
        if getattr(args, name) is not None
    }
    return LLM(
        args.model,
        parse_config(args.compilation_config),
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        use_transformers=args.use_transformers,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pipeline_layer_partition=args.pipeline_layer_partition,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        num_threads=args.num_threads,
        enable_prefix_caching=args.enable_prefix_caching,
        speculative_config=args.speculative_config,
        enable_lora=args.enable_lora,
        **sizes,
    )
