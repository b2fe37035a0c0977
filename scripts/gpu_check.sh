#!/usr/bin/env bash
# GPU check for the CUDA-graph work: `pytest -m cuda`, then the latency
# micro-benchmark (benchmarks/gpu_latency.py). Made to fit one 10-minute
# device call and to install nothing from the network.
#
#   bash scripts/gpu_check.sh            # results under $OUT (device tool) or benchmarks/results/gpu_check/
#
# Python packages the machine lacks (pydantic there) come from wheels in
# wheels/ or .whl/ at the repository root, when present. Budget in seconds:
# GPU_CHECK_BUDGET (default 560); the benchmark gets what the tests left.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/benchmarks/results/gpu_check}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-560}
PYFLAGS=""
export PYTHONUNBUFFERED=1
status=0

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"

echo "== dependencies (no network)"
for dir in wheels .whl; do
    if [ -d "$dir" ] && ls "$dir"/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/gpu_check_site "$dir"/*.whl && export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
    fi
done
if ! $PY -c "import pydantic" 2>/dev/null; then
    echo "pydantic is missing and no wheels/ or .whl/ holds it: compile_runtime cannot import" >&2
    exit 1
fi

echo "== compile_runtime"
if ! $PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT_DIR/install.log" 2>&1; then
    # No editable install: mirror the package layout (backends/ and passes/ live
    # inside compile_runtime once installed) with symbolic links.
    echo "editable install failed (see install.log); using a linked package tree"
    SHIM=/tmp/gpu_check_pkg
    rm -rf "$SHIM" && mkdir -p "$SHIM/compile_runtime"
    for f in "$ROOT"/compile_runtime/*; do ln -s "$f" "$SHIM/compile_runtime/"; done
    ln -s "$ROOT/backends" "$SHIM/compile_runtime/backends"
    ln -s "$ROOT/passes" "$SHIM/compile_runtime/passes"
    export PYTHONPATH=$SHIM${PYTHONPATH:+:$PYTHONPATH}
    PYFLAGS="-P"  # keep the current directory's compile_runtime/ from shadowing the tree
fi
$PY $PYFLAGS -c "import compile_runtime.backends, compile_runtime.cudagraph.wrapper as c; print('imported', c.__file__)" || exit 1

echo "== pytest -m cuda"
timeout $((BUDGET * 45 / 100)) $PY $PYFLAGS -m pytest -m cuda -q -p no:cacheprovider \
    --continue-on-collection-errors tests 2>&1 | tee "$OUT_DIR/pytest.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && { echo "pytest exit code $rc"; status=1; }

# bench NAME SCRIPT ARGS...: run one benchmark with the time left, its log and
# JSON under $OUT_DIR; a failure marks the check failed but the others still run.
bench() {
    local name=$1 script=$2
    shift 2
    echo "== $name"
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 60 ]; then
        echo "only ${left}s left: skipping $name"
        status=1
        return
    fi
    timeout "$left" $PY $PYFLAGS "$script" "$@" --out "$OUT_DIR/$name.json" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && { echo "$name exit code $rc (partial results stay in $name.json)"; status=1; }
}

# Latency of eager / PIECEWISE / FULL / reduce-overhead; attention backends
# (decode, eager vs graph); passes on vs off; default ladder vs planned sizes.
bench gpu_latency benchmarks/gpu_latency.py --iters 100 --warmup 10
bench attention benchmarks/attention.py --iters 100 --warmup 10
bench passes benchmarks/passes.py --device cuda
bench padding benchmarks/padding.py --latency --latency-steps 200

echo "== done in ${SECONDS}s, status $status"
exit $status
