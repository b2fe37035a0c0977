"""The ``compile-runtime`` command."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from compile_runtime.config import AttentionCGSupport, parse_config


def _config_show(args: argparse.Namespace) -> int:
    config = parse_config(args.compilation_config)
    resolved = config.resolve(AttentionCGSupport[args.attention_support])
    print(config.to_json())
    print(
        f"# resolved: mode={resolved.compilation_mode.name} "
        f"cudagraph_mode={resolved.cudagraph_mode.name} "
        f"(decode={resolved.decode_mode.name}, mixed={resolved.mixed_mode.name}) "
        f"hash={config.compute_hash()}"
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from compile_runtime.runner.llm import LLM
    from compile_runtime.runner.sampling_params import SamplingParams

    llm = LLM(
        args.model,
        parse_config(args.compilation_config),
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        use_transformers=args.use_transformers,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        num_threads=args.num_threads,
    )
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    with llm:  # stops the workers of a multi-process run, whatever happens
        outputs = llm.generate(args.prompt, params)
        for prompt, out in zip(args.prompt, outputs, strict=True):
            text = out.text if out.text is not None else out.token_ids
            print(f"{prompt!r} -> {text!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
        stats = llm.last_stats
        print(
            f"# {stats.output_tokens} tokens in {stats.seconds:.2f} s "
            f"({stats.tokens_per_second:.1f} tok/s), {stats.steps} steps; "
            f"compile {llm.compile_seconds:.2f} s"
        )
        if args.record_workload:
            llm.save_workload(args.record_workload)
            print(f"# workload histogram written to {args.record_workload}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from compile_runtime import __version__

    parser = argparse.ArgumentParser(prog="compile-runtime", description=__doc__)
    parser.add_argument("--version", action="version", version=f"compile-runtime {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser("config", help="show configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved CompilationConfig as JSON")
    show.add_argument("-O", "--compilation-config", default=None, help="CompilationConfig as JSON")
    show.add_argument(
        "--attention-support",
        default="ALWAYS",
        choices=[s.name for s in AttentionCGSupport],
        help="minimum AttentionCGSupport of the attention backends to resolve against",
    )
    show.set_defaults(func=_config_show)

    gen = sub.add_parser("generate", help="generate text from a model directory")
    gen.add_argument("--model", required=True, help="model directory (config.json + safetensors)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("-O", "--compilation-config", default=None, help="CompilationConfig as JSON")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    gen.add_argument("--max-num-seqs", type=int, default=16)
    gen.add_argument("--max-num-batched-tokens", type=int, default=256)
    gen.add_argument("--use-transformers", action="store_true", help="run through the adapter")
    gen.add_argument("--tensor-parallel-size", type=int, default=1)
    gen.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None)
    gen.add_argument("--record-workload", metavar="FILE", help="write the step-size histogram")
    gen.add_argument(
        "--num-threads", type=int, default=None, help="CPU threads (default: the free cores)"
    )
    gen.set_defaults(func=_generate)

    from compile_runtime.cache.cli import register as register_cache

    register_cache(sub)
    from compile_runtime.planner.cli import register as register_planner

    register_planner(sub)  # plan-sizes, check
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "prepare"):
        args.prepare(args)
    try:
        return args.func(args)
    except (ValidationError, ValueError, FileNotFoundError) as e:
        parser.exit(2, f"compile-runtime: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
