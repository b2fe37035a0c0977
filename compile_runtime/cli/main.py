"""The ``compile-runtime`` command.

A user error (bad argument, config, model directory, cache entry) ends in one
line on stderr, ``compile-runtime: error: ...``, and exit status 2; ``-vv``
adds its traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from pydantic import ValidationError
from safetensors import SafetensorError

from compile_runtime.cli.argtypes import float_in, int_at_least, positive_int
from compile_runtime.cli.cache import register as register_cache
from compile_runtime.cli.check import register as register_check
from compile_runtime.cli.engine_flags import add_engine_arguments, engine_from_args
from compile_runtime.cli.plan_sizes import register as register_plan_sizes
from compile_runtime.cli.serve import register as register_serve
from compile_runtime.cli.tune import register as register_tune
from compile_runtime.config import AttentionCGSupport, parse_config
from compile_runtime.version import __version__
from compile_runtime.worker.startup import ModelRunnerError

# ValueError covers pydantic's ValidationError, JSON errors and most of our own
# error classes (CacheError, WeightLoadingError, CudagraphModeError, ...);
# ModelRunnerError says what to change (a KV cache too small for max_model_len).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    OSError,
    SafetensorError,
    ModelRunnerError,
)


def format_error(error: BaseException) -> str:
    """``error`` in one line; a pydantic error as ``Model: field: message; field: message``."""
    if isinstance(error, ValidationError):
        fields = []
        for e in error.errors():
            where = ".".join(map(str, e["loc"]))
            message = e["msg"].removeprefix("Value error, ")
            fields.append(f"{where}: {message}" if where else message)
        return f"{error.title}: " + "; ".join(fields)
    return " ".join(str(error).split()) or type(error).__name__


class _Parser(argparse.ArgumentParser):
    """A usage error in one line: the full usage is one ``--help`` away."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    from compile_runtime.core.sampling_params import SamplingParams

    llm = engine_from_args(args)
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
            c = out.outputs[0]
            text = c.text if c.text is not None else c.token_ids
            print(f"{prompt!r} -> {text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
        stats = llm.last_stats
        print(
            f"# {stats.output_tokens} tokens in {stats.seconds:.2f} s "
            f"({stats.tokens_per_second:.1f} tok/s), {stats.steps} steps, prefix cache hit "
            f"rate {stats.prefix_cache.hit_rate:.0%} ({stats.prefix_cache.hits} of "
            f"{stats.prefix_cache.queries} prompt tokens)"
        )
        if stats.spec_decode.num_draft_tokens:
            spec = stats.spec_decode
            print(
                f"# speculative decoding: {spec.num_accepted_tokens} of {spec.num_draft_tokens} "
                f"draft tokens accepted ({spec.acceptance_rate:.0%}), "
                f"{spec.mean_accepted_length:.2f} tokens per verifying step"
            )
        print(f"# {llm.startup.summary()}")
        if args.record_workload:
            llm.save_workload(args.record_workload)
            print(f"# workload histogram written to {args.record_workload}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="compile-runtime", description=__doc__)
    parser.add_argument("--version", action="version", version=f"compile-runtime {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="-v: show INFO logs (what was compiled, loaded, captured); -vv: also our DEBUG "
        "logs, and the traceback of an error",
    )
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
    add_engine_arguments(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=positive_int, default=32)
    gen.add_argument("--temperature", type=float_in(0.0, float("inf")), default=0.0)
    gen.add_argument("--top-k", type=int_at_least(0), default=0, help="0: off")
    gen.add_argument("--top-p", type=float_in(0.0, 1.0, low_open=True), default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--record-workload", metavar="FILE", help="write the step-size histogram")
    gen.set_defaults(func=_generate)

    register_serve(sub)

    register_cache(sub)
    register_plan_sizes(sub)
    register_check(sub)
    register_tune(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Warnings (a downgraded cudagraph_mode, a quarantined cache entry) must reach the user.
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.verbose > 1:  # our debug lines, not every library's
        logging.getLogger("compile_runtime").setLevel(logging.DEBUG)
    try:
        if hasattr(args, "prepare"):
            args.prepare(args)
        return args.func(args)
    except USER_ERRORS as e:
        if args.verbose > 1:
            traceback.print_exc()
        print(f"compile-runtime: error: {format_error(e)}", file=sys.stderr)
        return 2
