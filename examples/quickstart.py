"""Quick start: build a config, resolve it for this machine, print it."""

from __future__ import annotations

import compile_runtime as cr


def main() -> None:
    config = cr.CompilationConfig(
        mode="PIECEWISE",
        backend="inductor",
        cudagraph_mode="FULL_AND_PIECEWISE",
        max_cudagraph_capture_size=64,
    )
    resolved = config.resolve(cr.AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    print(config.to_json())
    print(f"capture sizes: {config.capture_sizes()}")
    print(
        f"resolved on this machine: decode={resolved.decode_mode.name} "
        f"mixed={resolved.mixed_mode.name}; config hash {config.compute_hash()}"
    )


if __name__ == "__main__":
    main()
