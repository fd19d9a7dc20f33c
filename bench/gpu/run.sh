#!/usr/bin/env bash
# The GPU path in one command, for a lent GPU machine (see bench/gpu/README.md):
#
#   bench/gpu/run.sh OUT_DIR [--dry]
#
# 1. unpacks the carried packages (.gpu-site.tar.xz, made here by `make gpu-site`: UCX and the
#    serving stack) into /tmp/site;
# 2. runs every `gpu`-marked test (Triton kernels against their torch references on CUDA,
#    bf16 and float32; the engine on CUDA, float32 greedy equal to the CPU engine);
# 3. moves KV between two processes on the GPU over UCX (bench/bench_kv_transfer.py
#    --device cuda: byte-exact, GB/s against a device-to-device copy);
# 4. times the Triton decode attention and KV pack kernels against a device copy
#    (bench/bench_kernels_gpu.py);
# 5. times a Llama-8B-shaped decode step at batch 1/8/64 against the HBM bound and a prefill
#    chunk against the bf16 matmul peak (bench/gpu/step_times.py);
# 6. serves: `splitserve up` (a coordinator, a prefill and a decode worker on the GPU) on random
#    Llama-8B-shaped weights drawn at each worker's start (--model random:llama-8b), driven at
#    three Poisson rates of a chat and a long-prompt workload: TTFT, ITL, output tok/s and
#    goodput under an SLO, decode steps against the HBM bound (bench/gpu/serve_goodput.py;
#    SERVE_GOODPUT_SHAPE=llama-1b where time is short);
# 7. writes OUT_DIR/gpu-run.json (every step's status, seconds and results) beside
#    OUT_DIR/run.log.
#
# Each step has its own time limit (a whole run took 263 s on an H200 on 2026-11-30, 131 of them
# serving), cut to what is left of RUN_BUDGET_S (default 570: one 10-minute device call, with
# the summary's time kept back); a step that no longer fits is skipped, saying so. A failed
# step does not stop the next. --dry (or no CUDA device) skips what needs
# CUDA and runs the rest; `make test` runs it so (tests/test_gpu_script.py). The exit status
# is 0 when every step that ran passed.
# PYTHON names the interpreter (default python3: the GPU image's, which holds torch).
set -u -o pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [--dry]" >&2
    exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
dry=0
[ "${2:-}" = "--dry" ] && dry=1
repo=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
log="$out/run.log"
steps="$out/steps.tsv"
: >"$log"
: >"$steps"
cd "$repo" || exit 2

say() { echo "[gpu-run $(date +%T)] $*" | tee -a "$log" >&2; }

budget=${RUN_BUDGET_S:-570}
reserve=20  # kept back for the summary and a killed step's grace

# step NAME LIMIT_S COMMAND...: runs it with its output in the log; records name, status, s.
# The limit is cut to the budget left (less the reserve); under 10 s left, the step is skipped.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((budget - reserve - SECONDS))
    if [ "$left" -lt 10 ]; then
        skip "$name" "out of time (${SECONDS}s of the ${budget}s budget used)"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "step $name (limit ${limit}s): $*"
    local started=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local status=passed
    [ $rc -ne 0 ] && status="failed rc=$rc"
    [ $rc -eq 124 ] && status="timed out"
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - started))" >>"$steps"
    say "step $name: $status in $((SECONDS - started))s"
}

skip() {
    printf '%s\t%s\t0\n' "$1" "skipped: $2" >>"$steps"
    say "step $1: skipped ($2)"
}


# The package `splitserve` is the repo's folders linked under one folder on PYTHONPATH.
source "$repo/bench/gpu/stage.sh"
stage=$(stage_package "$repo")
site=/tmp/site
export PYTHONPATH="$stage:$site:$repo/bench${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# One interpreter start for the facts and the CUDA check (exit 3: no CUDA device).
"$py" - >>"$log" 2>&1 <<'PYEOF'
import platform, sys, torch
import splitserve.engine
print("python", platform.python_version(), "torch", torch.__version__,
      "cuda", torch.cuda.is_available() and torch.cuda.get_device_name())
print("splitserve from", list(splitserve.engine.__path__))
sys.exit(0 if torch.cuda.is_available() else 3)
PYEOF
facts=$?
if [ $facts -eq 3 ]; then
    [ $dry -eq 0 ] && say "no CUDA device: dry mode"
    dry=1
elif [ $facts -ne 0 ]; then  # the package or torch does not import: every step would fail
    printf 'environment\tfailed rc=%s\t0\n' "$facts" >>"$steps"
    say "the environment check failed (rc=$facts, see the log): dry mode"
    dry=1
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >>"$log" 2>&1
fi

# The packages the image lacks: .gpu-site.tar.xz (make gpu-site), else .whl/ and .whl-serve/.
if [ $dry -eq 1 ] && [ -f .gpu-site.tar.xz ]; then  # lists and unpacks it into a temporary folder
    step site 45 "$py" bench/gpu/site.py check .gpu-site.tar.xz
elif [ $dry -eq 1 ]; then
    skip site "dry mode, no .gpu-site.tar.xz"
elif [ -f .gpu-site.tar.xz ] || compgen -G ".whl*/*.whl" >/dev/null; then
    step site 45 "$py" bench/gpu/site.py install "$site"
else
    skip site "no .gpu-site.tar.xz: run make gpu-site before the call"
fi
step gpu-tests 150 "$py" -m pytest --noconftest -p no:cacheprovider -q -rfEs -m gpu \
    --junitxml="$out/gpu-tests.xml" tests/test_gpu_kernels.py tests/test_gpu_engine.py \
    tests/test_gpu_transfer.py
step kv-transfer 110 "$py" bench/bench_kv_transfer.py --device cuda --reps 5 --ucx-proto-info \
    --out "$out/kv_transfer.json"
if [ $dry -eq 1 ]; then
    skip kernel-bench "dry mode"
else
    step kernel-bench 50 bash -c '"$0" bench/bench_kernels_gpu.py >"$1"' "$py" "$out/kernel_bench.json"
fi
step step-times 130 "$py" bench/gpu/step_times.py --out "$out/step_times.json"
# Serving goodput; dry: its CPU variant (the tiny shape on the CPU, about 20 s).
if [ $dry -eq 1 ]; then
    step serve-goodput 120 "$py" bench/gpu/serve_goodput.py --cpu-tiny \
        --out "$out/serve_goodput.json"
else
    step serve-goodput 260 "$py" bench/gpu/serve_goodput.py \
        --shape "${SERVE_GOODPUT_SHAPE:-llama-8b}" --out "$out/serve_goodput.json"
fi
rm -rf "$stage"

"$py" bench/gpu/summarize.py "$out" --dry "$dry" >>"$log" 2>&1
summary=$?
say "wrote $out/gpu-run.json (summary rc=$summary)"
if grep -qE $'\t(failed|timed out)' "$steps" || [ $summary -ne 0 ]; then
    exit 1
fi
exit 0
