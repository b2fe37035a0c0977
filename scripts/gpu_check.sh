#!/usr/bin/env bash
# GPU check for the CUDA-graph work: the CUDA tests and the GPU benchmarks, in one device
# call (`all`, the plan below) or in two (parts `a` and `b`). Each run fits
# GPU_CHECK_BUDGET seconds (default 560 for `all`, 280 for a part), shared by its steps in
# the order of importance below and enforced with `timeout`; writes at most 7 files under
# $OUT (8 come back from a call): check.log (every step's output, stderr too) and each
# benchmark's JSON. Tables go to stdout; nothing is installed from the network.
#
#   all (one call of at most 600 s; shares in seconds, most important first):
#     setup           25  wheels, imports, nvcc, the test modules that skip here
#     pytest_a       100  pytest -m cuda over tests/ but test_attention_cuda.py and
#                         test_passes_cuda.py: the engine in every graph mode against
#                         transformers (9 LLM start-ups), the toy model's real graphs, the
#                         runner's mode resolution; every test module is collected, so the
#                         ones that skip (a missing optional dependency) are listed
#     gpu_decode      85  benchmarks/gpu_decode.py: median decode-step ms at batch 1/8/64 of
#                         the ~33M Llama, eager vs PIECEWISE vs FULL vs FULL_AND_PIECEWISE
#     flashinfer     130  FlashInfer, from .whl/flashinfer/ (on the path in this step only):
#                         JIT-build the decode and prefill kernels of the ~33M model (head
#                         dim 64, bf16, page 16; scripts/flashinfer_prebuild.py) within
#                         60% of the step's time, the build time printed; if it does not fit,
#                         the step says so and is skipped (not failed). Built: a FULL decode
#                         graph on FlashInfer vs Triton vs torch_native (bf16, eager and full
#                         each, tokens checked), then the FlashInfer cuda tests, those whose
#                         kernels were just built first, the others only if their JIT builds
#                         (estimated from this one) fit the time left
#     pytest_b        75  pytest -m cuda tests/test_attention_cuda.py tests/test_passes_cuda.py
#                         (Triton attention against torch_native, FULL graph replays; the
#                         fused ops' kernels, 2 cold Inductor LLM start-ups)
#     gpu_decode_hf   35  the anchor: transformers + reduce-overhead, a static cache
#     attention       30  benchmarks/attention.py: each attention backend, eager vs graph
#     passes          40  benchmarks/passes.py --device cuda --variants off on
#     padding         40  benchmarks/padding.py --latency: default ladder vs planned sizes
#   part a: pytest_a 105, gpu_decode 100, gpu_decode_hf 50 (of 280)
#   part b: pytest_b 95, attention 40, passes 60, padding 60 (of 280)
#   Files: check.log, STEP.json for each benchmark step, flashinfer_decode.json.
#
# A step may use its share plus whatever the steps before it left unused, never the later
# steps' shares (those scale with GPU_CHECK_BUDGET); one left with under 30 s is not
# started, and says so. A step cut at its limit still reports: pytest turns SIGTERM into
# KeyboardInterrupt and prints its summary (and, where pytest-timeout is installed, fails a
# test over 90 s and goes on); every benchmark writes its JSON after each measurement and
# prints the table of what it measured when stopped.
#
# Here (with network), once: fetch the wheels the device lacks (pydantic & co., FlashInfer
# and what its JIT needs) and check the size of what travels (64 MiB at most):
#
#   bash scripts/fetch_device_wheels.sh
#
# then one device call carrying them:
#
#   run(command="bash scripts/gpu_check.sh all", carry=[".whl"], timeout_s=600)
#
# Wheels in wheels/ or .whl/ are installed with --no-deps into a scratch folder put first
# on PYTHONPATH, those in .whl/flashinfer/ into another one, on the path in the flashinfer
# step only: the device's own torch is never replaced. The exit status is 0 when every step
# passed or was skipped for a reason it printed, 1 when one failed, timed out or had no
# time left (or CUDA is missing), 2 for a usage error.
#
# CPU smoke test of the plumbing (every step, tiny settings, eager backend where the
# benchmark has one, the CPU's attention backends standing in for FlashInfer; uses
# .venv/bin/python when there):
#
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh all
#
# Environment: OUT (results; default benchmarks/results/gpu_check), PYTHON
# (default python3), GPU_CHECK_BUDGET, GPU_CHECK_DEVICE (cuda | cpu),
# GPU_CHECK_WORK (scratch: wheels, install log, model, JIT cache; default $TMPDIR/gpu_check),
# GPU_CHECK_LINKED_TREE=1 (use the linked package tree even if an install works),
# GPU_CHECK_STEPS (the steps to run, e.g. "pytest_b padding"; default all of the part's),
# GPU_CHECK_PYTEST (the pytest steps' test selection instead of the part's, e.g.
# "-m cuda tests/test_engine_cuda.py"), GPU_CHECK_MIN_STEP (default 30 s),
# GPU_CHECK_FLASHINFER_BUILD (the share of the flashinfer step its JIT build may take, in
# percent; default 60).
set -uo pipefail

usage() {
    cat >&2 <<'EOF'
usage: bash scripts/gpu_check.sh all|a|b
  all: one device call of at most 600 s, most important first: pytest -m cuda (the engine,
       the toy graphs), decode ms/step eager vs PIECEWISE vs FULL vs FULL_AND_PIECEWISE
       (benchmarks/gpu_decode.py), FlashInfer (JIT build of the model's kernels, then a FULL
       decode graph on it vs Triton vs torch_native, then its cuda tests), pytest -m cuda
       (attention kernels, fused ops), transformers + reduce-overhead, benchmarks/attention.py,
       benchmarks/passes.py --device cuda, benchmarks/padding.py --latency
  a:   the first of those without FlashInfer: pytest_a, gpu_decode, gpu_decode_hf
  b:   the rest: pytest_b, attention, passes, padding
env: GPU_CHECK_BUDGET (seconds, default 560 for all, 280 for a part), GPU_CHECK_DEVICE=cpu
     (CPU smoke test), GPU_CHECK_STEPS (steps to run), GPU_CHECK_PYTEST (tests to run), OUT
     (results folder), PYTHON (interpreter)
EOF
}

PART=${1:-}
case "$PART" in
all | a | b) ;;
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
CALL_LIMIT=600 # what one device call may run, in seconds
# The plan: each step's share of PLAN_BUDGET seconds, in the order the steps run (most
# important first); SETUP is what the set-up before them is expected to take.
SETUP=25
case "$PART" in
all)
    PLAN_BUDGET=560
    PLAN=(pytest_a:100 gpu_decode:85 flashinfer:130 pytest_b:75 gpu_decode_hf:35 attention:30)
    PLAN+=(passes:40 padding:40)
    ;;
a)
    PLAN_BUDGET=280
    PLAN=(pytest_a:105 gpu_decode:100 gpu_decode_hf:50)
    ;;
b)
    PLAN_BUDGET=280
    PLAN=(pytest_b:95 attention:40 passes:60 padding:60)
    ;;
esac
BUDGET=${GPU_CHECK_BUDGET:-$PLAN_BUDGET}
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]]; then
    echo "GPU_CHECK_BUDGET=$BUDGET: a number of seconds" >&2
    exit 2
fi
MIN_STEP=${GPU_CHECK_MIN_STEP:-30} # a step with less time than this is not started
if ! [[ "$MIN_STEP" =~ ^[0-9]+$ ]]; then
    echo "GPU_CHECK_MIN_STEP=$MIN_STEP: a number of seconds" >&2
    exit 2
fi
FI_BUILD_PCT=${GPU_CHECK_FLASHINFER_BUILD:-60}
if ! [[ "$FI_BUILD_PCT" =~ ^[0-9]+$ ]] || [ "$FI_BUILD_PCT" -gt 100 ]; then
    echo "GPU_CHECK_FLASHINFER_BUILD=$FI_BUILD_PCT: a percentage" >&2
    exit 2
fi
PER_TEST=90 # pytest-timeout's limit per test, where it is installed

declare -A WHAT=(
    [pytest_a]="pytest -m cuda tests/ but test_attention_cuda.py, test_passes_cuda.py (all modules collected)"
    [gpu_decode]="benchmarks/gpu_decode.py: decode ms/step, eager, PIECEWISE, FULL, FULL_AND_PIECEWISE"
    [flashinfer]="FlashInfer: JIT build (bounded), FULL decode vs Triton vs torch_native, its cuda tests"
    [pytest_b]="pytest -m cuda tests/test_attention_cuda.py tests/test_passes_cuda.py"
    [gpu_decode_hf]="benchmarks/gpu_decode.py: transformers + reduce-overhead (the anchor)"
    [attention]="benchmarks/attention.py: each attention backend, eager vs CUDA graph"
    [passes]="benchmarks/passes.py: graph passes off vs on"
    [padding]="benchmarks/padding.py --latency: default capture sizes vs planned ones"
)
TESTS_A=(-m cuda tests --ignore=tests/test_attention_cuda.py --ignore=tests/test_passes_cuda.py)
TESTS_B=(-m cuda tests/test_attention_cuda.py tests/test_passes_cuda.py)
if [ -n "${GPU_CHECK_PYTEST:-}" ]; then
    read -r -a TESTS_A <<<"$GPU_CHECK_PYTEST"
    TESTS_B=("${TESTS_A[@]}")
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
LOG=$OUT_DIR/check.log # every step's output, stderr too: one file (8 come back)
: >"$LOG"

echo "== part $PART on $DEVICE: budget ${BUDGET}s, results in $OUT_DIR"
echo "== plan, in this order (a step gets its share plus what the steps before it left;" \
    "under ${MIN_STEP}s left, it is not started):"
setup_share=$((SETUP * BUDGET / PLAN_BUDGET))
printf '   %-14s %4ss  %s\n' setup "~$setup_share" \
    "wheels, imports, nvcc, the test modules that skip here"
planned=$setup_share
for i in "${!NAMES[@]}"; do
    note=${WHAT[${NAMES[$i]}]}
    [[ "$SELECTED" == *" ${NAMES[$i]} "* ]] || note="(not run: GPU_CHECK_STEPS) $note"
    printf '%d. %-14s %4ss  %s\n' $((i + 1)) "${NAMES[$i]}" "${SHARES[$i]}" "$note"
    planned=$((planned + SHARES[i]))
done
echo "== plan total: ${planned}s (setup and steps), the budget ${BUDGET}s; one device call" \
    "runs at most ${CALL_LIMIT}s: $([ "$BUDGET" -le $((CALL_LIMIT - 20)) ] && echo fits ||
        echo "DOES NOT FIT, lower GPU_CHECK_BUDGET")"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
if command -v nvcc >/dev/null 2>&1; then
    echo "nvcc: $(nvcc --version | tail -n 2 | head -n 1)"
elif [ "$DEVICE" = cuda ]; then
    echo "nvcc: not on PATH (FlashInfer's JIT needs it; CUDA_HOME=${CUDA_HOME:-unset})"
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

# FlashInfer and what its JIT needs: a scratch folder of their own, on the path in the
# flashinfer step only (the other steps run as on a machine without it).
FI_SITE= FI_STATE="no .whl/flashinfer/"
shopt -s nullglob
FI_WHEELS=(.whl/flashinfer/*.whl)
shopt -u nullglob
if [[ "$SELECTED" != *" flashinfer "* ]]; then
    FI_STATE="not needed (no flashinfer step)"
elif "$PY" -c "import flashinfer" 2>/dev/null; then
    FI_STATE="installed on this machine: $("$PY" -c "import flashinfer; print(flashinfer.__version__)" 2>/dev/null)"
elif [ "$DEVICE" = cpu ]; then
    FI_STATE="not installed (CPU smoke test: FlashInfer runs on CUDA only)"
elif [ ${#FI_WHEELS[@]} -gt 0 ]; then
    FI_SITE=$WORK/site_flashinfer
    rm -rf "$FI_SITE"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$FI_SITE" "${FI_WHEELS[@]}" >"$WORK/wheels_flashinfer.log" 2>&1 &&
        PYTHONPATH=$FI_SITE${PYTHONPATH:+:$PYTHONPATH} "$PY" -c "import flashinfer" \
            >>"$WORK/wheels_flashinfer.log" 2>&1; then
        FI_STATE="installed ${#FI_WHEELS[@]} wheels into $FI_SITE: flashinfer $(
            PYTHONPATH=$FI_SITE "$PY" -c "import importlib.metadata as m; print(m.version('flashinfer-python'))" 2>/dev/null)"
    else
        FI_STATE="could not install or import FlashInfer from .whl/flashinfer/: $(tail -n 1 "$WORK/wheels_flashinfer.log")"
        FI_SITE=
    fi
fi
echo "flashinfer: $FI_STATE"

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
FILES=(check.log)

# step_limit NAME: the seconds step NAME may run (the time left minus the shares of the
# selected steps after it), into LIMIT; prints the step's header. Returns 1, with the step
# in the summary, when it is not selected or has under MIN_STEP seconds left.
step_limit() {
    local name=$1 reserve=0 later=0 i
    if [[ "$SELECTED" != *" $name "* ]]; then
        SUMMARY+=("$name: not run (GPU_CHECK_STEPS)")
        return 1
    fi
    for i in "${!NAMES[@]}"; do
        if [ "$later" = 1 ] && [[ "$SELECTED" == *" ${NAMES[$i]} "* ]]; then
            reserve=$((reserve + SHARES[i]))
        fi
        [ "${NAMES[$i]}" = "$name" ] && later=1
    done
    LIMIT=$((BUDGET - SECONDS - reserve))
    echo "== $name (at most ${LIMIT}s; ${reserve}s kept for the steps after it)"
    if [ "$LIMIT" -lt "$MIN_STEP" ]; then
        echo "only ${LIMIT}s left for $name: not started"
        SUMMARY+=("$name: NOT STARTED (${LIMIT}s left)")
        status=1
        return 1
    fi
}

# limited SECONDS LOG CMD...: CMD under `timeout`, stdout to the terminal and LOG, stderr to
# LOG only; its exit code in RC, its seconds in TOOK, its first line in LOG at LOG_FROM.
limited() {
    local seconds=$1 log=$2 start=$SECONDS
    shift 2
    LOG_FROM=$(($(wc -l <"$log") + 1))
    timeout -k 15 "$seconds" "$@" </dev/null 2>>"$log" | tee -a "$log"
    RC=${PIPESTATUS[0]} TOOK=$((SECONDS - start))
}

# outcome NAME RC TOOK LIMIT: the summary line of a command that ran.
outcome() {
    local name=$1 rc=$2 took=$3 limit=$4
    if [ "$rc" -eq 0 ]; then
        echo "ok (${took}s)"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "TIMED OUT after ${took}s (limit ${limit}s)"
    else
        echo "FAILED, exit code $rc (${took}s)"
    fi
}

# step NAME CMD...: run CMD within step_limit's time. A failure marks the run failed, and
# the next steps still run.
step() {
    local name=$1
    shift
    step_limit "$name" || return 0
    local log=$LOG
    echo "===== $name (at most ${LIMIT}s)" >>"$log"
    limited "$LIMIT" "$log" "$@"
    SUMMARY+=("$name: $(outcome "$name" "$RC" "$TOOK" "$LIMIT")")
    [ "$RC" -eq 0 ] || status=1
    if [ "$RC" -ne 0 ] && [[ "$name" != pytest_* ]]; then # the error is in stderr
        echo "-- $name exit code $RC; last lines of its log ($LOG):"
        tail -n 15 "$log"
    fi
}

pytest_cmd() { # the pytest command line for test selection "$@"
    PYTEST_CMD=("${PYTEST[@]}" -q -rfEs --tb=short --durations=5 -p no:cacheprovider
        --continue-on-collection-errors "${TIMEOUT_ARGS[@]}" "$@")
}

# The last command's pytest summary line ("3 passed, 1 skipped in 20.1s"), from the log.
pytest_line() {
    local last
    last=$(tail -n "+$LOG_FROM" "$LOG" | grep -E \
        '(passed|failed|skipped|deselected|xfailed|xpassed|errors?|no tests ran) in [0-9.]+s' |
        tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
    echo "${last:-no pytest summary line}"
}

# tests NAME SELECTION...: a pytest step; its summary line goes into the run's summary.
tests() {
    local name=$1
    shift
    pytest_cmd "$@"
    step "$name" "${PYTEST_CMD[@]}"
    if [[ "${SUMMARY[${#SUMMARY[@]} - 1]}" != *"not run"* && "${SUMMARY[-1]}" != *"NOT STARTED"* ]]; then
        SUMMARY[${#SUMMARY[@]} - 1]+=" - $(pytest_line)"
    fi
}

# bench NAME SCRIPT ARGS...: a benchmark script, its JSON at $OUT_DIR/NAME.json.
bench() {
    local name=$1 script=$2
    shift 2
    [[ "$SELECTED" == *" $name "* ]] && FILES+=("$name.json")
    step "$name" "${RUN[@]}" "$script" "$@" --out "$OUT_DIR/$name.json"
}

# The flashinfer step: the JIT build of the model's kernels within FI_BUILD_PCT% of the
# step's time (skipped, and said so, when it does not fit), then a FULL decode graph on
# FlashInfer vs Triton vs torch_native, then FlashInfer's cuda tests: first those that use
# the kernels just built, the others if their builds (about three like this one) fit.
flashinfer_step() {
    local name=flashinfer
    step_limit "$name" || return 0
    local log=$LOG end=$((SECONDS + LIMIT)) notes=() fi_env build_limit
    FILES+=("${name}_decode.json")
    echo "===== $name (at most ${LIMIT}s)" >>"$log"
    if [ "$DEVICE" = cuda ] && [ -z "$FI_SITE" ] && ! "$PY" -c "import flashinfer" 2>/dev/null; then
        echo "FlashInfer is not available ($FI_STATE): step skipped"
        SUMMARY+=("$name: SKIPPED (FlashInfer not available: $FI_STATE)")
        return 0
    fi
    fi_env=(env "FLASHINFER_WORKSPACE_BASE=$WORK/flashinfer_jit")
    if [ -n "$FI_SITE" ]; then
        fi_env+=("PYTHONPATH=$FI_SITE${PYTHONPATH:+:$PYTHONPATH}" "PATH=$FI_SITE/bin:$PATH")
    fi
    build_limit=$((LIMIT * FI_BUILD_PCT / 100 > 0 ? LIMIT * FI_BUILD_PCT / 100 : 1)) # 0: no limit
    echo "-- JIT build of the model's decode and prefill kernels (at most ${build_limit}s)"
    limited "$build_limit" "$log" "${fi_env[@]}" "$PY" ${SHIM:+-P} scripts/flashinfer_prebuild.py
    local build_s=$TOOK
    if [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then
        echo "FlashInfer's JIT build did not finish in ${build_s}s (its bound: ${build_limit}s):" \
            "the FlashInfer decode timings and tests are skipped"
        SUMMARY+=("$name: SKIPPED (JIT build over ${build_limit}s: stopped after ${build_s}s)")
        return 0
    elif [ "$RC" -ne 0 ]; then
        echo "-- the JIT build failed (exit code $RC); last lines of its log ($LOG):"
        tail -n 15 "$log"
        SUMMARY+=("$name: FAILED, JIT build exit code $RC (${build_s}s)")
        status=1
        return 0
    fi
    echo "JIT build: ${build_s}s"
    notes+=("build ${build_s}s")

    local left=$((end - SECONDS)) decode
    decode=(--dtype bfloat16 --backend eager --configs eager full --check-tokens)
    decode+=(--model-dir "$WORK/llama-33m" --out "$OUT_DIR/${name}_decode.json")
    if [ "$DEVICE" = cuda ]; then
        decode+=(--device cuda --max-tokens 32 --attention-backends flashinfer triton torch_native)
    else # the CPU's backends stand in: the plumbing, not FlashInfer
        decode+=(--device cpu --batch-sizes 1 2 --max-tokens 8 --repeats 1)
        decode+=(--attention-backends cpu_batched torch_native)
    fi
    local decode_limit=$((left * 55 / 100 > 0 ? left * 55 / 100 : 1))
    echo "-- FULL decode graph, FlashInfer vs Triton vs torch_native (at most ${decode_limit}s)"
    limited "$decode_limit" "$log" "${fi_env[@]}" "${RUN[@]}" benchmarks/gpu_decode.py "${decode[@]}"
    notes+=("decode $(outcome "$name" "$RC" "$TOOK" "$decode_limit")")
    [ "$RC" -eq 0 ] || tail -n 15 "$log"

    # Tests: the engine's on the llama (the kernels just built) first; the others (Gemma 2's
    # window and soft cap, head size 128 in fp16 and bf16) need about three more such builds.
    local first=(-m cuda tests/test_engine_cuda.py -k "flashinfer and llama")
    local rest=(-m cuda tests/test_engine_cuda.py tests/test_attention_cuda.py)
    rest+=(-k "flashinfer and not llama")
    left=$((end - SECONDS))
    if [ "$left" -lt "$MIN_STEP" ]; then
        notes+=("tests not started (${left}s left)")
        status=1
    else
        pytest_cmd "${first[@]}"
        echo "-- FlashInfer tests on the kernels just built (at most ${left}s)"
        limited "$left" "$log" "${fi_env[@]}" "${PYTEST_CMD[@]}"
        notes+=("tests $(outcome "$name" "$RC" "$TOOK" "$left") - $(pytest_line)")
        left=$((end - SECONDS))
        local need=$((3 * build_s + 20))
        if [ "$left" -lt "$need" ] || [ "$left" -lt "$MIN_STEP" ]; then
            echo "the other FlashInfer tests need about ${need}s (three JIT builds like this" \
                "one), ${left}s left: not run"
            notes+=("other tests not run (need ~${need}s, ${left}s left)")
        else
            pytest_cmd "${rest[@]}"
            echo "-- the other FlashInfer tests (at most ${left}s)"
            limited "$left" "$log" "${fi_env[@]}" "${PYTEST_CMD[@]}"
            notes+=("other tests $(outcome "$name" "$RC" "$TOOK" "$left") - $(pytest_line)")
        fi
    fi
    local joined
    joined=$(printf '%s; ' "${notes[@]}")
    if [[ "$joined" == *FAILED* || "$joined" == *"TIMED OUT"* || "$joined" == *"not started"* ]]; then
        status=1
        SUMMARY+=("$name: FAILED (${joined%; })")
    else
        SUMMARY+=("$name: ok (${joined%; })")
    fi
}

# The benchmarks' settings: the device's, or tiny ones for the CPU smoke test.
ours=(--configs eager piecewise full full_and_piecewise --model-dir "$WORK/llama-33m")
hf=(--configs hf_reduce_overhead --model-dir "$WORK/llama-33m")
if [ "$DEVICE" = cuda ]; then
    common=(--device cuda)
    attention=(--device cuda --iters 100 --warmup 10)
    # off vs on: two cold Inductor compiles; "default" is "on" on CUDA, and the one-fusion
    # variants would cost a compile each.
    passes=(--device cuda --variants off on)
    # 6000 scheduler steps: one period of steady-decode's arrival swing (batch 1..64).
    padding=(--latency --device cuda --backend inductor --steps 6000 --latency-steps 100)
    padding+=(--warmup 10)
else
    common=(--device cpu --backend eager --batch-sizes 1 2 --max-tokens 8 --repeats 1)
    attention=(--device cpu --dtype float32 --batch-sizes 1 2 --context 40 --num-heads 4)
    attention+=(--num-kv-heads 2 --head-size 64 --iters 2 --warmup 1)
    passes=(--device cpu --variants off --tokens 1 16 --iters 3 --warmup 1 --threads 1)
    padding=(--latency --device cpu --backend eager --workloads steady-decode --steps 1000)
    padding+=(--latency-steps 2 --warmup 1)
fi

for name in "${NAMES[@]}"; do
    case "$name" in
    pytest_a) tests pytest_a "${TESTS_A[@]}" ;;
    pytest_b) tests pytest_b "${TESTS_B[@]}" ;;
    gpu_decode) bench gpu_decode benchmarks/gpu_decode.py "${common[@]}" "${ours[@]}" ;;
    gpu_decode_hf) bench gpu_decode_hf benchmarks/gpu_decode.py "${common[@]}" "${hf[@]}" ;;
    flashinfer) flashinfer_step ;;
    attention) bench attention benchmarks/attention.py "${attention[@]}" ;;
    passes) bench passes benchmarks/passes.py "${passes[@]}" ;;
    padding) bench padding benchmarks/padding.py "${padding[@]}" ;;
    esac
done

echo "== summary: part $PART on $DEVICE, ${SECONDS}s of ${BUDGET}s"
printf '%s\n' "${SUMMARY[@]}"
written=()
for f in "${FILES[@]}"; do [ -f "$OUT_DIR/$f" ] && written+=("$f"); done
echo "files in $OUT_DIR: ${written[*]:-none}"
echo "exit status $status"
exit $status
