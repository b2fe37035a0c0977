#!/usr/bin/env bash
# Run HERE (with network), before the device call: fetch the wheels the GPU machine
# lacks (Python 3.12, x86_64, torch 2.11 + triton 3.6 + nvcc installed, no pydantic, no
# FlashInfer, no network) into .whl/ (ignored by git), then check that the working tree
# and the wheels together fit what one device call carries (64 MiB).
#
#   bash scripts/fetch_device_wheels.sh            # fetch, list the sizes, check the total
#   bash scripts/fetch_device_wheels.sh --dry-run  # what it would fetch and the size check,
#                                                  # no network (and .whl/ left as it is)
#
# Then carry the folder on the device call; gpu_check.sh installs the wheels with --no-deps
# into its scratch folder, so the device's own torch is never replaced:
#
#   run(command="bash scripts/gpu_check.sh all", carry=[".whl"], timeout_s=600)
#
# Two sets:
# * .whl/: what compile_runtime needs to import (pydantic and what it needs), at the
#   versions this checkout's venv uses. The device has pytest, hypothesis, pytest-timeout
#   and transformers (so numpy, requests, tqdm, packaging); it lacks openai, jsonschema,
#   fastapi, uvicorn (the server tests' and structured-output tests' modules skip there:
#   pytest.importorskip) and gguf, xgrammar (imported lazily, by no CUDA test or GPU
#   benchmark).
# * .whl/flashinfer/: FlashInfer (pure Python: its kernels are JIT-built with the device's
#   nvcc, so any torch will do; every release since 0.5 asks only for "torch", unbounded) and
#   what `import flashinfer` and its JIT need that a bare torch machine lacks: apache-tvm-ffi
#   (the JIT's bindings; a cp312 wheel), ninja (the JIT's build tool), nvidia-ml-py (pynvml),
#   einops, tabulate, click (the GPU image has the last five, a bare torch machine may not:
#   carried anyway, 0.5 MB, on the path in the flashinfer step only). Its other
#   requirements (cuda-python, cudnn-frontend, cutlass-dsl, nccl) serve kernels the paged
#   decode/prefill wrappers never load. FLASHINFER_VERSION
#   picks the release: 0.7.x wheels (~100 MB, bundled sources of every kernel family) do not
#   fit the 64 MiB; 0.6.18.post1 (~18 MB) does.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
case "${1:-}" in
"") ;;
--dry-run) DRY_RUN=1 ;;
*)
    echo "usage: bash scripts/fetch_device_wheels.sh [--dry-run]" >&2
    exit 2
    ;;
esac
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=${WHEELS_DIR:-.whl} # what the device call carries (another folder: tests only)
LIMIT=$((64 * 1024 * 1024)) # what one device call carries: tracked files + carried folders
# pydantic and what it needs; typing-extensions too (pydantic 2.14 needs >= 4.16).
PACKAGES="pydantic pydantic-core annotated-types typing-inspection typing-extensions"
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.6.18.post1}
FLASHINFER_PINS="flashinfer-python==$FLASHINFER_VERSION apache-tvm-ffi==0.1.15.post2
ninja==1.13.2 nvidia-ml-py==13.615.71 einops==0.8.2 tabulate==0.10.0 click==8.5.1"

pins=""
for name in $PACKAGES; do
    version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    pins="$pins $name==$version"
done

mib() { awk -v b="$1" 'BEGIN { printf "%.2f MiB", b / 1048576 }'; }

# The working tree that travels: tracked files and untracked ones git does not ignore.
tree_bytes() {
    git ls-files -z --cached --others --exclude-standard |
        du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1
}

# size_check: list every wheel under .whl/ with its size; fail when the tree plus the
# wheels exceed LIMIT.
size_check() {
    local tree total=0 size f
    tree=$(tree_bytes)
    echo "wheels:"
    shopt -s nullglob
    for f in "$DEST"/*.whl "$DEST"/flashinfer/*.whl; do
        size=$(stat -c %s "$f")
        total=$((total + size))
        printf '  %10d  %s\n' "$size" "$f"
    done
    shopt -u nullglob
    echo "wheels total: $total bytes ($(mib "$total"))"
    echo "working tree (tracked + untracked not ignored): $tree bytes ($(mib "$tree"))"
    echo "carried in all: $((tree + total)) bytes ($(mib $((tree + total)))) of $(mib "$LIMIT")"
    if [ $((tree + total)) -gt "$LIMIT" ]; then
        echo "TOO LARGE: the tree and .whl/ exceed the $(mib "$LIMIT") one device call carries;" \
            "pick a smaller FLASHINFER_VERSION (FLASHINFER_VERSION=0.5.3: ~7 MB) or leave" \
            "FlashInfer out (rm -r .whl/flashinfer)" >&2
        return 1
    fi
}

if [ "$DRY_RUN" = 1 ]; then
    echo "would fetch into $DEST/ (cp312, manylinux x86_64, --no-deps):"
    for p in $pins; do echo "  $p"; done
    echo "would fetch into $DEST/flashinfer/:"
    for p in $FLASHINFER_PINS; do echo "  $p"; done
    tree=$(tree_bytes)
    echo "working tree (tracked + untracked not ignored): $tree bytes ($(mib "$tree"));" \
        "room for wheels: $(mib $((LIMIT - tree)))"
    if [ -d "$DEST" ]; then
        echo "size check of the wheels in $DEST/ now:"
        size_check
    fi
    exit 0
fi

fetch() { # fetch DEST PIN...: binary wheels for CPython 3.12 on manylinux x86_64
    local dest=$1
    shift
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "$@"
}
rm -rf "$DEST" && mkdir -p "$DEST/flashinfer"
# shellcheck disable=SC2086
fetch "$DEST" $pins
# shellcheck disable=SC2086
fetch "$DEST/flashinfer" $FLASHINFER_PINS
echo "fetched into $DEST/ and $DEST/flashinfer/"
size_check
