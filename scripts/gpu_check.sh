#!/usr/bin/env bash
# GPU check for the CUDA-graph work, in two parts: one device call each, run one
# right after the other (the machine stays warm 30 s between calls). Each part
# fits GPU_CHECK_BUDGET seconds (default 280), shared by its steps in the order
# of importance below and enforced with `timeout`; writes at most 8 files under
# $OUT (what one call brings back); prints every table to stdout (stderr goes to
# the step's log only) and installs nothing from the network.
#
#   part a (most important first):
#     pytest_a       105 s  pytest -m cuda over tests/ but test_attention_cuda.py and
#                           test_passes_cuda.py: the engine in every graph mode against
#                           transformers (9 LLM start-ups), the toy model's real graphs,
#                           the runner's mode resolution; every test module is collected, so
#                           the ones that skip (a missing optional dependency) are listed
#     gpu_decode     100 s  benchmarks/gpu_decode.py: median decode-step ms at batch 1/8/64 of
#                           the ~33M Llama, eager vs PIECEWISE vs FULL vs FULL_AND_PIECEWISE
#     gpu_decode_hf   50 s  the same for transformers + reduce-overhead, as time allows
#     Files: pytest_a.log, gpu_decode.{log,json}, gpu_decode_hf.{log,json}
#   part b:
#     pytest_b        95 s  pytest -m cuda tests/test_attention_cuda.py tests/test_passes_cuda.py
#                           (Triton/FlashInfer attention against torch_native, FULL graph
#                           replays; the fused ops' kernels, 2 cold Inductor LLM start-ups)
#     attention       40 s  benchmarks/attention.py: each attention backend, eager vs graph
#     passes          60 s  benchmarks/passes.py --device cuda --variants off on
#     padding         60 s  benchmarks/padding.py --latency: default ladder vs planned sizes
#     Files: pytest_b.log, attention.{log,json}, passes.{log,json}, padding.{log,json}
#
# Each part keeps ~25 s for its set-up (wheels, imports, the skip listing). A step may use
# its share plus whatever the steps before it left unused, never the later steps' shares
# (those scale with GPU_CHECK_BUDGET); one left with under 30 s is not started. A step cut
# at its limit still reports: pytest turns SIGTERM into KeyboardInterrupt and prints its
# summary (and, where pytest-timeout is installed, fails a test over 90 s and goes on);
# every benchmark writes its JSON after each measurement and prints the table of what it
# measured when stopped.
#
# Here (with network), once: fetch the wheels the device lacks (pydantic & co.):
#
#   bash scripts/fetch_device_wheels.sh
#
# then two device-tool calls, the second right after the first, carrying them:
#
#   run(command="bash scripts/gpu_check.sh a", carry=[".whl"], timeout_s=330)
#   run(command="bash scripts/gpu_check.sh b", carry=[".whl"], timeout_s=330)
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
# GPU_CHECK_LINKED_TREE=1 (use the linked package tree even if an install works),
# GPU_CHECK_STEPS (the part's steps to run, e.g. "pytest_b padding"; default all),
# GPU_CHECK_PYTEST (the pytest step's test selection instead of the part's, e.g.
# "-m cuda tests/test_engine_cuda.py"), GPU_CHECK_MIN_STEP (default 30 s).
set -uo pipefail

usage() {
    cat >&2 <<'EOF'
usage: bash scripts/gpu_check.sh a|b
  a: pytest -m cuda (the engine, the toy graphs), then decode ms/step eager vs PIECEWISE vs
     FULL vs FULL_AND_PIECEWISE (benchmarks/gpu_decode.py), then transformers + reduce-overhead
  b: pytest -m cuda (attention kernels, fused ops), then benchmarks/attention.py,
     benchmarks/passes.py --device cuda, benchmarks/padding.py --latency
env: GPU_CHECK_BUDGET (seconds per part, default 280), GPU_CHECK_DEVICE=cpu (CPU smoke
     test), GPU_CHECK_STEPS (steps to run), GPU_CHECK_PYTEST (tests to run), OUT (results
     folder), PYTHON (interpreter)
EOF
}

PART=${1:-}
case "$PART" in
a | b) ;;
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
MIN_STEP=${GPU_CHECK_MIN_STEP:-30} # a step with less time than this is not started
if ! [[ "$MIN_STEP" =~ ^[0-9]+$ ]]; then
    echo "GPU_CHECK_MIN_STEP=$MIN_STEP: a number of seconds" >&2
    exit 2
fi
PER_TEST=90 # pytest-timeout's limit per test, where it is installed

# The plan: each step's share of PLAN_BUDGET seconds, in the order the steps run (most
# important first); SETUP is what the set-up before them is expected to take.
PLAN_BUDGET=280
SETUP=25
case "$PART" in
a)
    PLAN=(pytest_a:105 gpu_decode:100 gpu_decode_hf:50)
    WHAT=(
        "pytest -m cuda tests/ but test_attention_cuda.py, test_passes_cuda.py (all modules collected)"
        "benchmarks/gpu_decode.py: decode ms/step, eager, PIECEWISE, FULL, FULL_AND_PIECEWISE"
        "benchmarks/gpu_decode.py: transformers + reduce-overhead (as time allows)"
    )
    TESTS=(-m cuda tests --ignore=tests/test_attention_cuda.py --ignore=tests/test_passes_cuda.py)
    ;;
b)
    PLAN=(pytest_b:95 attention:40 passes:60 padding:60)
    WHAT=(
        "pytest -m cuda tests/test_attention_cuda.py tests/test_passes_cuda.py"
        "benchmarks/attention.py: each attention backend, eager vs CUDA graph"
        "benchmarks/passes.py: graph passes off vs on"
        "benchmarks/padding.py --latency: default capture sizes vs planned ones"
    )
    TESTS=(-m cuda tests/test_attention_cuda.py tests/test_passes_cuda.py)
    ;;
esac
if [ -n "${GPU_CHECK_PYTEST:-}" ]; then
    read -r -a TESTS <<<"$GPU_CHECK_PYTEST"
fi
NAMES=() SHARES=()
for entry in "${PLAN[@]}"; do
    NAMES+=("${entry%%:*}")
    SHARES+=($((${entry##*:} * BUDGET / PLAN_BUDGET)))
done
SELECTED=" ${NAMES[*]} "
if [ -n "${GPU_CHECK_STEPS:-}" ]; then
    for name in $GPU_CHECK_STEPS; do
        if [[ "$SELECTED" != *" $name "* ]]; then
            echo "GPU_CHECK_STEPS: part $PART has no step $name (its steps: ${NAMES[*]})" >&2
            exit 2
        fi
    done
    SELECTED=" $GPU_CHECK_STEPS "
fi

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
echo "== plan, in this order (a step gets its share plus what the steps before it left;" \
    "under ${MIN_STEP}s left, it is not started):"
printf '   %-14s %4ss  %s\n' setup "~$((SETUP * BUDGET / PLAN_BUDGET))" \
    "wheels, imports, the test modules that skip here"
for i in "${!NAMES[@]}"; do
    note=${WHAT[$i]}
    [[ "$SELECTED" == *" ${NAMES[$i]} "* ]] || note="(not run: GPU_CHECK_STEPS) $note"
    printf '%d. %-14s %4ss  %s\n' $((i + 1)) "${NAMES[$i]}" "${SHARES[$i]}" "$note"
done
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
CHECK="import compile_runtime.backends, compile_runtime.passes, compile_runtime.graphs.wrapper as c; print('imported', c.__file__)"
# pytest with SIGTERM (the step's time limit) as KeyboardInterrupt: a cut run still prints
# its summary (what passed, failed and skipped, and where it stopped).
PYTEST_MAIN="import signal, sys, pytest; signal.signal(signal.SIGTERM, signal.default_int_handler); sys.exit(pytest.console_main())"
PYTEST=("$PY" -c "$PYTEST_MAIN")
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
        PYTEST=("$PY" -P -c "$PYTEST_MAIN")
        RUN=("$PY" -P -c "import os, runpy, sys; import compile_runtime.backends, compile_runtime.passes; sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0]))); runpy.run_path(sys.argv[0], run_name='__main__')")
    fi
    "$PY" ${SHIM:+-P} -c "$CHECK" || exit 1
fi


echo "== test modules that skip here (pytest.importorskip of an optional dependency)"
"$PY" ${SHIM:+-P} - <<'EOF'
import importlib.util, pathlib, re

SKIP = re.compile(r"""^pytest\.importorskip\(\s*["']([\w.]+)["']""", re.M)
IMPORT = re.compile(r"^(?:from\s+(\w+)\s+import|import\s+(\w+))", re.M)
texts = {p.stem: p.read_text() for p in sorted(pathlib.Path("tests").glob("*.py"))}


def needs(stem, seen=()):
    """The optional dependencies a module asks for, its helper modules' (serving.py) too."""
    names = SKIP.findall(texts[stem])
    for a, b in IMPORT.findall(texts[stem]):
        other = a or b
        if other in texts and other not in seen and other != stem:
            names += needs(other, (*seen, stem))
    return list(dict.fromkeys(names))


def present(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


asked = {stem: needs(stem) for stem in texts}
deps = sorted({d for names in asked.values() for d in names})
have = {d: present(d) for d in deps}
print("optional test dependencies: " + ", ".join(f"{d} {'yes' if have[d] else 'NO'}" for d in deps))
modules = [stem for stem in texts if stem.startswith("test_")]
skipped = 0
for stem in modules:
    missing = [d for d in asked[stem] if not have[d]]
    if missing:
        skipped += 1
        print(f"skips: tests/{stem}.py (missing {', '.join(missing)})")
print(f"{skipped} of {len(modules)} test modules skip here" + ("" if skipped else ": none"))
EOF
if [ "$PER_TEST" -gt 0 ] && "$PY" -c "import pytest_timeout" 2>/dev/null; then
    TIMEOUT_ARGS=(--timeout="$PER_TEST")
    echo "pytest-timeout is installed: a test over ${PER_TEST}s fails and the run goes on"
else
    TIMEOUT_ARGS=()
    echo "pytest-timeout is not installed: no per-test limit (the step's limit still holds)"
fi

status=0
SUMMARY=()
FILES=()

# step NAME CMD...: run CMD with the part's time left minus the shares of the selected steps
# after it. stdout goes to the terminal and NAME.log, stderr to NAME.log only; a failure
# marks the part failed, and the next steps still run.
step() {
    local name=$1
    shift
    if [[ "$SELECTED" != *" $name "* ]]; then
        SUMMARY+=("$name: not run (GPU_CHECK_STEPS)")
        return
    fi
    local reserve=0 later=0 i
    for i in "${!NAMES[@]}"; do
        if [ "$later" = 1 ] && [[ "$SELECTED" == *" ${NAMES[$i]} "* ]]; then
            reserve=$((reserve + SHARES[i]))
        fi
        [ "${NAMES[$i]}" = "$name" ] && later=1
    done
    local log="$OUT_DIR/$name.log" limit=$((BUDGET - SECONDS - reserve)) start=$SECONDS
    echo "== $name (at most ${limit}s; ${reserve}s kept for the steps after it)"
    if [ "$limit" -lt "$MIN_STEP" ]; then
        echo "only ${limit}s left for $name: not started"
        SUMMARY+=("$name: NOT STARTED (${limit}s left)")
        status=1
        return
    fi
    FILES+=("$name.log")
    : >"$log"
    timeout -k 15 "$limit" "$@" </dev/null 2>>"$log" | tee -a "$log"
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
    if [[ "$name" != pytest_* ]]; then # stdout was shown; the error is in stderr
        echo "-- $name exit code $rc; last lines of $name.log:"
        tail -n 15 "$log"
    fi
}

# tests NAME: the part's pytest step; its summary line goes into the part's summary.
tests() {
    local name=$1
    step "$name" "${PYTEST[@]}" -q -rfEs --tb=short --durations=5 -p no:cacheprovider \
        --continue-on-collection-errors "${TIMEOUT_ARGS[@]}" "${TESTS[@]}"
    local log="$OUT_DIR/$name.log" last
    if [ -s "$log" ]; then
        last=$(grep -E '(passed|failed|skipped|deselected|xfailed|xpassed|errors?|no tests ran) in [0-9.]+s' \
            "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
        SUMMARY[${#SUMMARY[@]} - 1]+=" - ${last:-no pytest summary line}"
    fi
}

# bench NAME SCRIPT ARGS...: a benchmark script, its JSON at $OUT_DIR/NAME.json.
bench() {
    local name=$1 script=$2
    shift 2
    [[ "$SELECTED" == *" $name "* ]] && FILES+=("$name.json")
    step "$name" "${RUN[@]}" "$script" "$@" --out "$OUT_DIR/$name.json"
}

case "$PART" in
a)
    tests pytest_a
    ours=(--configs eager piecewise full full_and_piecewise --model-dir "$WORK/llama-33m")
    hf=(--configs hf_reduce_overhead --model-dir "$WORK/llama-33m")
    if [ "$DEVICE" = cuda ]; then
        common=(--device cuda)
    else
        common=(--device cpu --backend eager --batch-sizes 1 2 --max-tokens 8 --repeats 1)
    fi
    bench gpu_decode benchmarks/gpu_decode.py "${common[@]}" "${ours[@]}"
    bench gpu_decode_hf benchmarks/gpu_decode.py "${common[@]}" "${hf[@]}"
    ;;
b)
    tests pytest_b
    if [ "$DEVICE" = cuda ]; then
        attention=(--device cuda --iters 100 --warmup 10)
        # off vs on: two cold Inductor compiles; "default" is "on" on CUDA, and the one-fusion
        # variants would cost a compile each.
        passes=(--device cuda --variants off on)
        # 6000 scheduler steps: one period of steady-decode's arrival swing (batch 1..64).
        padding=(--latency --device cuda --backend inductor --steps 6000 --latency-steps 100)
        padding+=(--warmup 10)
    else
        attention=(--device cpu --dtype float32 --batch-sizes 1 2 --context 40 --num-heads 4)
        attention+=(--num-kv-heads 2 --head-size 64 --iters 2 --warmup 1)
        passes=(--device cpu --variants off --tokens 1 16 --iters 3 --warmup 1 --threads 1)
        padding=(--latency --device cpu --backend eager --workloads steady-decode --steps 1000)
        padding+=(--latency-steps 2 --warmup 1)
    fi
    bench attention benchmarks/attention.py "${attention[@]}"
    bench passes benchmarks/passes.py "${passes[@]}"
    bench padding benchmarks/padding.py "${padding[@]}"
    ;;
esac

echo "== summary: part $PART on $DEVICE, ${SECONDS}s of ${BUDGET}s"
printf '%s\n' "${SUMMARY[@]}"
written=()
for f in "${FILES[@]}"; do [ -f "$OUT_DIR/$f" ] && written+=("$f"); done
echo "files in $OUT_DIR: ${written[*]:-none}"
echo "exit status $status"
exit $status
