#!/usr/bin/env bash
# GPU check for the CUDA-graph work, in three parts; each part fits one short
# device call (GPU_CHECK_BUDGET seconds, default 280, shared by its steps and
# enforced with `timeout`), writes at most 4 files under $OUT, prints every
# table to stdout (stderr goes to the step's log only) and installs nothing
# from the network.
#
#   part a: pytest -m cuda -q over tests/, then benchmarks/gpu_decode.py: median
#           decode-step ms at batch 1/8/64 of the ~33M Llama, eager vs PIECEWISE vs
#           FULL vs FULL_AND_PIECEWISE vs transformers + reduce-overhead.
#           Files: pytest.log, gpu_decode.log, gpu_decode.json
#   part b: benchmarks/attention.py (each attention backend, eager vs CUDA graph),
#           then benchmarks/passes.py --device cuda (graph passes on vs off).
#           Files: attention.log, attention.json, passes.log, passes.json
#   part c: benchmarks/padding.py --latency (padding of the default capture-size
#           ladder vs planned sizes, and ms/step with piecewise graphs at each).
#           Files: padding.log, padding.json
#
# Here (with network), once: fetch the wheels the device lacks (pydantic & co.):
#
#   bash scripts/fetch_device_wheels.sh
#
# then one device-tool call per part, carrying them:
#
#   run(command="bash scripts/gpu_check.sh a", carry=[".whl"], timeout_s=330)
#   run(command="bash scripts/gpu_check.sh b", carry=[".whl"], timeout_s=330)
#   run(command="bash scripts/gpu_check.sh c", carry=[".whl"], timeout_s=330)
#
# Wheels in wheels/ or .whl/ are installed with --no-deps into a scratch folder
# put first on PYTHONPATH: the device's own torch is never replaced. The
# exit status is 0 when every step passed, 1 when one failed, timed out or
# had no time left (or CUDA is missing), 2 for a usage error.
#
# CPU smoke test of the plumbing (every step, tiny settings, eager backend where
# the benchmark has one; uses .venv/bin/python when there):
#
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh a
#
# Environment: OUT (results; default benchmarks/results/gpu_check), PYTHON
# (default python3), GPU_CHECK_BUDGET, GPU_CHECK_DEVICE (cuda | cpu),
# GPU_CHECK_WORK (scratch: wheels, install log, model; default $TMPDIR/gpu_check),
# GPU_CHECK_LINKED_TREE=1 (use the linked package tree even if an install works).
set -uo pipefail

usage() {
    cat >&2 <<'EOF'
usage: bash scripts/gpu_check.sh a|b|c
  a: pytest -m cuda, then the decode-latency table (benchmarks/gpu_decode.py)
  b: benchmarks/attention.py, then benchmarks/passes.py --device cuda
  c: benchmarks/padding.py --latency
env: GPU_CHECK_BUDGET (seconds per part, default 280), GPU_CHECK_DEVICE=cpu (CPU smoke
     test), OUT (results folder), PYTHON (interpreter)
EOF
}

PART=${1:-}
case "$PART" in
a | b | c) ;;
*)
    [ -n "$PART" ] && echo "unknown part: $PART" >&2
    usage
    exit 2
    ;;
esac
if [ $# -ne 1 ]; then
    usage
    exit 2
fi
DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "$DEVICE" != cuda ] && [ "$DEVICE" != cpu ]; then
    echo "GPU_CHECK_DEVICE=$DEVICE: use cuda (the default) or cpu" >&2
    exit 2
fi
BUDGET=${GPU_CHECK_BUDGET:-280}
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]]; then
    echo "GPU_CHECK_BUDGET=$BUDGET: a number of seconds" >&2
    exit 2
fi
MIN_STEP=30 # a step with less time than this is not started

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/benchmarks/results/gpu_check}
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu_check}
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ]; then
    PY=$ROOT/.venv/bin/python
fi
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
export COMPILE_RUNTIME_CACHE_DIR=${COMPILE_RUNTIME_CACHE_DIR:-$WORK/compile_cache}

if [ "$DEVICE" = cuda ] &&
    ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "CUDA is not available to $PY: this script is for the GPU machine" \
        "(GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh $PART runs a CPU smoke test)" >&2
    exit 1
fi
mkdir -p "$OUT_DIR" "$WORK" || exit 1

echo "== part $PART on $DEVICE: budget ${BUDGET}s, results in $OUT_DIR"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PY" - <<'EOF'
import importlib.metadata as md, sys, torch
line = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
line.append(f"cuda {torch.version.cuda} available={torch.cuda.is_available()}")
for name in ("triton", "transformers", "flashinfer-python", "pydantic"):
    try:
        line.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        line.append(f"{name} -")
print(", ".join(line))
EOF

echo "== dependencies (no network)"
shopt -s nullglob
WHEELS=(wheels/*.whl .whl/*.whl)
shopt -u nullglob
PYDANTIC2="import sys, pydantic; sys.exit(0 if int(pydantic.VERSION.split('.')[0]) >= 2 else 1)"
if [ ${#WHEELS[@]} -gt 0 ] && "$PY" -c "$PYDANTIC2" 2>/dev/null; then
    echo "pydantic 2 is installed: the ${#WHEELS[@]} wheels are not needed"
elif [ ${#WHEELS[@]} -gt 0 ]; then
    SITE=$WORK/site
    rm -rf "$SITE"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${WHEELS[@]}" >"$WORK/wheels.log" 2>&1; then
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
        echo "installed ${#WHEELS[@]} wheels into $SITE"
    else
        echo "could not install the wheels for $PY (see $WORK/wheels.log); using what it has"
    fi
fi
if ! "$PY" -c "$PYDANTIC2" 2>/dev/null; then
    echo "pydantic 2 is missing and no wheels/ or .whl/ holds it: compile_runtime cannot import" \
        "(run bash scripts/fetch_device_wheels.sh here and carry .whl)" >&2
    exit 1
fi

echo "== compile_runtime"
CHECK="import compile_runtime.backends, compile_runtime.passes, compile_runtime.cudagraph.wrapper as c; print('imported', c.__file__)"
PYTEST=("$PY" -m pytest)
RUN=("$PY") # how a benchmark script starts
if [ -z "${GPU_CHECK_LINKED_TREE:-}" ] && "$PY" -c "$CHECK" 2>/dev/null; then
    : # installed already (an editable install, as in this checkout's .venv)
else
    if [ -z "${GPU_CHECK_LINKED_TREE:-}" ] &&
        "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/install.log" 2>&1; then
        echo "editable install done"
    else
        # No editable install: mirror the package layout (backends/ and passes/ live
        # inside compile_runtime once installed) with symbolic links, first on the path.
        echo "using a linked package tree${GPU_CHECK_LINKED_TREE:+ (GPU_CHECK_LINKED_TREE is set)}${GPU_CHECK_LINKED_TREE:-: the editable install failed, see $WORK/install.log}"
        SHIM=$WORK/pkg
        rm -rf "$SHIM" && mkdir -p "$SHIM/compile_runtime"
        for f in "$ROOT"/compile_runtime/*; do ln -s "$f" "$SHIM/compile_runtime/"; done
        ln -s "$ROOT/backends" "$SHIM/compile_runtime/backends"
        ln -s "$ROOT/passes" "$SHIM/compile_runtime/passes"
        export PYTHONPATH=$SHIM${PYTHONPATH:+:$PYTHONPATH}
        # -P keeps the current directory's compile_runtime/ from shadowing the tree; a
        # script starts through runpy after compile_runtime is imported from the tree, so
        # one that puts the repository root first on sys.path (padding.py) still gets it.
        PYTEST=("$PY" -P -m pytest)
        RUN=("$PY" -P -c "import os, runpy, sys; import compile_runtime.backends, compile_runtime.passes; sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0]))); runpy.run_path(sys.argv[0], run_name='__main__')")
    fi
    "$PY" ${SHIM:+-P} -c "$CHECK" || exit 1
fi

status=0
SUMMARY=()
FILES=()

# step NAME RESERVE CMD...: run CMD with the part's time left minus RESERVE seconds
# (kept for the steps after it). stdout goes to the terminal and NAME.log, stderr to
# NAME.log only; a failure marks the part failed, and the next steps still run.
step() {
    local name=$1 reserve=$2
    shift 2
    local log="$OUT_DIR/$name.log" limit=$((BUDGET - SECONDS - reserve)) start=$SECONDS
    echo "== $name (at most ${limit}s)"
    if [ "$limit" -lt "$MIN_STEP" ]; then
        echo "only ${limit}s left for $name: not started"
        SUMMARY+=("$name: NOT STARTED (${limit}s left)")
        status=1
        return
    fi
    FILES+=("$name.log")
    : >"$log"
    timeout -k 10 "$limit" "$@" </dev/null 2>>"$log" | tee -a "$log"
    local rc=${PIPESTATUS[0]} took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("$name: ok (${took}s)")
        return
    fi
    status=1
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        SUMMARY+=("$name: TIMED OUT after ${took}s (limit ${limit}s)")
    else
        SUMMARY+=("$name: FAILED, exit code $rc (${took}s)")
    fi
    if [ "$name" != pytest ]; then # stdout was shown; the error is in stderr
        echo "-- $name exit code $rc; last lines of $name.log:"
        tail -n 15 "$log"
    fi
}

# bench NAME RESERVE SCRIPT ARGS...: a benchmark script, its JSON at $OUT_DIR/NAME.json.
bench() {
    local name=$1 reserve=$2 script=$3
    shift 3
    FILES+=("$name.json")
    step "$name" "$reserve" "${RUN[@]}" "$script" "$@" --out "$OUT_DIR/$name.json"
}

case "$PART" in
a)
    step pytest $((BUDGET * 55 / 100)) "${PYTEST[@]}" -m cuda -q -rfEs --tb=short --durations=5 \
        -p no:cacheprovider --continue-on-collection-errors tests
    [ -s "$OUT_DIR/pytest.log" ] && SUMMARY[${#SUMMARY[@]} - 1]+=" - $(tail -n 1 "$OUT_DIR/pytest.log")"
    if [ "$DEVICE" = cuda ]; then
        args=(--device cuda)
    else
        args=(--device cpu --backend eager --batch-sizes 1 2 --max-tokens 8 --repeats 1)
    fi
    bench gpu_decode 0 benchmarks/gpu_decode.py "${args[@]}" --model-dir "$WORK/llama-33m"
    ;;
b)
    if [ "$DEVICE" = cuda ]; then
        attention=(--device cuda --iters 100 --warmup 10)
        passes=(--device cuda)
    else
        attention=(--device cpu --dtype float32 --batch-sizes 1 2 --context 40 --num-heads 4)
        attention+=(--num-kv-heads 2 --head-size 64 --iters 2 --warmup 1)
        passes=(--device cpu --variants off --tokens 1 16 --iters 3 --warmup 1 --threads 1)
    fi
    bench attention $((BUDGET * 60 / 100)) benchmarks/attention.py "${attention[@]}"
    bench passes 0 benchmarks/passes.py "${passes[@]}"
    ;;
c)
    if [ "$DEVICE" = cuda ]; then
        args=(--latency --device cuda --backend inductor --latency-steps 200 --warmup 20)
    else
        args=(--latency --device cpu --backend eager --workloads steady-decode --steps 1000)
        args+=(--latency-steps 2 --warmup 1)
    fi
    bench padding 0 benchmarks/padding.py "${args[@]}"
    ;;
esac

echo "== summary: part $PART on $DEVICE, ${SECONDS}s of ${BUDGET}s"
printf '%s\n' "${SUMMARY[@]}"
written=()
for f in "${FILES[@]}"; do [ -f "$OUT_DIR/$f" ] && written+=("$f"); done
echo "files in $OUT_DIR: ${written[*]:-none}"
echo "exit status $status"
exit $status
