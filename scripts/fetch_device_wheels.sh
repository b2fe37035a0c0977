#!/usr/bin/env bash
# Run HERE (with network), before a device call: fetch the wheels the GPU machine
# lacks (Python 3.12, x86_64, torch 2.11 installed, no pydantic, no network) into
# .whl/ (ignored by git), at the versions this checkout's venv uses.
#
#   bash scripts/fetch_device_wheels.sh
#
# Then carry the folder on both device calls; gpu_check.sh installs the wheels
# with --no-deps into /tmp, so the device's own torch is never replaced:
#
#   run(command="bash scripts/gpu_check.sh a", carry=[".whl"], timeout_s=330)
#   run(command="bash scripts/gpu_check.sh b", carry=[".whl"], timeout_s=330)
#
# Only what compile_runtime needs to import is fetched. The device has pytest, hypothesis
# and pytest-timeout; it lacks openai, jsonschema, fastapi, uvicorn (the server tests' and
# structured-output tests' modules skip there: pytest.importorskip) and gguf, xgrammar
# (imported lazily, by no CUDA test or GPU benchmark).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=.whl
# pydantic and what it needs; typing-extensions too (pydantic 2.14 needs >= 4.16).
PACKAGES="pydantic pydantic-core annotated-types typing-inspection typing-extensions"

pins=""
for name in $PACKAGES; do
    version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    pins="$pins $name==$version"
done
rm -rf "$DEST" && mkdir -p "$DEST"
# shellcheck disable=SC2086
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" $pins
echo "fetched into $DEST/:"
ls -1 "$DEST"
