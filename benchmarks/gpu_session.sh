#!/usr/bin/env bash
# One lease of a lent GPU machine: the CUDA tests, the GPU benchmarks and the main job on a GPU.
#
# Usage (from the repository root, on the GPU machine): bash benchmarks/gpu_session.sh [STEP ...]
# STEPs (default: all but profile and tune, in this order): env tests kernels unscale syncbn loss demo
# suite; unscale: the unscale pass against copies of the same bytes, kernel versions and launch
# constants (diagnosis); profile: op tables of one loss-scaler step; tune: launch-constant sweep of
# the BatchNorm kernels (diagnosis).
# Each step's log is appended to $OUT/session.log as it ends (default OUT: ./gpu_out), the GPU result
# sections and the demo's summary.png are copied there (few files: the device tool returns at most 8);
# each step has its own time limit so one slow step cannot eat the lease. The machine's own python3
# (with torch, triton, lightning) is used; the package is imported from the checkout (PYTHONPATH),
# nothing is installed. Failures are listed one line each with their messages (--tb=line -rf), so
# the tail that comes back says what failed and why.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
PY="${PYTHON:-python3}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests kernels unscale syncbn loss demo suite)

run() {  # run NAME LIMIT_S CMD...: log, append to $OUT/session.log, print the tail and the exit status
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    { echo "=== $name: exit $rc in $((SECONDS - t0)) s"; cat "$LOGS/$name.log"; } >>"$OUT/session.log"
    echo "=== $name: exit $rc in $((SECONDS - t0)) s"
    tail -n "${TAIL:-25}" "$LOGS/$name.log"
}

for step in "${steps[@]}"; do
    case $step in
    env)
        run env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version \
            --format=csv; $PY -c 'import torch, triton, lightning; print(torch.__version__, \
            torch.version.cuda, triton.__version__, lightning.__version__, torch.cuda.get_device_name())'"
        ;;
    tests)  # every test that needs CUDA, then the kernel/nn/amp suites with CUDA present
        run tests 240 "$PY" -m pytest -p no:cacheprovider -q --tb=line -rf --timeout 200 \
            tests/kernels/test_cuda.py tests/stats/test_reporting.py tests/callbacks/test_iteration_timer.py \
            tests/amp/test_dynamic_loss_scaler.py tests/kernels/test_registry.py
        ;;
    kernels) run kernels 240 "$PY" benchmarks/bench_kernels.py --gpu-only ;;
    syncbn) run syncbn 120 "$PY" benchmarks/bench_syncbn.py --gpu-only ;;
    loss) run loss 120 "$PY" benchmarks/bench_loss_scaling.py --device cuda ;;
    tune) run tune 240 "$PY" benchmarks/tune_kernels_gpu.py ;;
    unscale) run unscale 240 "$PY" benchmarks/tune_unscale_gpu.py ;;
    profile) run profile 120 "$PY" benchmarks/bench_loss_scaling.py --device cuda --profile ;;
    demo)
        run demo 150 "$PY" -m lightning_ext.examples.digits --accelerator gpu --devices 1 \
            --root "$LOGS/runs" --name digits_gpu
        cp "$LOGS/runs/digits_gpu/summary.png" "$OUT/summary_gpu.png" 2>/dev/null
        ;;
    suite)  # the interpreter-mode kernel tests need Triton >= 3.9 (CI's); GPU images may carry older
        run suite 400 "$PY" -m pytest -p no:cacheprovider -q --tb=line -rf --timeout 300 -n 8 \
            -k "not triton-interpret and not TritonBackend" lightning_ext tests
        ;;
    *) echo "unknown step: $step" >&2 ;;
    esac
done
cp benchmarks/results/*_gpu.md "$OUT"/ 2>/dev/null || true
