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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValidationError, ValueError) as e:
        parser.exit(2, f"compile-runtime: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
