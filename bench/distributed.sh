#!/usr/bin/env bash
# Issue 8's GPU measurements in one go on a host with 2 GPUs (NCCL), ~8 minutes at most:
#     bash bench/distributed.sh OUT            # then read the table it prints, or OUT/summary.json
#     bash bench/distributed.sh OUT --smoke    # the same path on CPU with gloo and tiny sizes (the test runs this)
#     PYTHON=.venv/bin/python bash bench/distributed.sh OUT   # ranks start with that interpreter
#     bash bench/distributed.sh OUT --one-gpu  # only the one-GPU phases (dp on 1 GPU, the longest sequence):
#                                              # what a one-GPU host can measure, 280 s at most
# Each phase is its own torchrun launch with a hard timeout (a phase that overruns is cut, the others still run);
# inside, each phase keeps to a softer --budget-s, and rank 0 rewrites OUT/<phase>.json after every measurement.
# Limits in seconds (GPU): dp on 1 GPU 120 (includes compiling the Triton kernels), dp on 2 GPUs 60, context
# parallel 1M 170, one-GPU longest sequence 160: 510 in all (+10 s grace each, the report takes seconds), so one
# call of 10 minutes holds it even when every phase runs to its limit.
set -u
OUT=${1:?usage: bash bench/distributed.sh OUT [--smoke]}
shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}   # long sequences: less fragmentation
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# NVLink multicast stays off on the shared GPU hosts (it can take the host's GPUs out of service): keep it off here too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The Python that has the project installed: $PYTHON (the tests pass their own interpreter), else the first on PATH.
PY=${PYTHON:-$(command -v python3 || command -v python)}
SMOKE=0
ONE_GPU=0
ARGS=()                     # what the phases get: everything but --one-gpu
for a in "$@"; do
    case "$a" in
        --smoke) SMOKE=1; ARGS+=("$a") ;;
        --one-gpu) ONE_GPU=1 ;;
        *) ARGS+=("$a") ;;
    esac
done
set -- "${ARGS[@]+"${ARGS[@]}"}"

phase() {  # phase NPROC HARD_LIMIT SOFT_BUDGET NAME [args...]
    local n=$1 hard=$2 soft=$3
    shift 3
    echo "=== $* on $n rank(s), limit ${hard}s" | tee -a "$OUT/log.txt"
    timeout --kill-after=10 "$hard" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
        bench/distributed.py "$@" --out "$OUT" --budget-s "$soft" >>"$OUT/log.txt" 2>&1
    echo "=== exit $? after $SECONDS s in all" | tee -a "$OUT/log.txt"
}

if [ "$SMOKE" = 1 ]; then
    phase 1 120 60 dp "$@"
    [ "$ONE_GPU" = 1 ] || phase 2 120 60 dp "$@"
    [ "$ONE_GPU" = 1 ] || phase 2 120 60 cp "$@"
    phase 1 120 60 longest --simulate-oom-above 128 "$@"      # 256 "runs out of memory", 128 holds
else
    phase 1 120 95 dp "$@"
    [ "$ONE_GPU" = 1 ] || phase 2 60 40 dp "$@"
    [ "$ONE_GPU" = 1 ] || phase 2 170 110 cp "$@"
    phase 1 160 160 longest "$@"
fi
"$PY" bench/distributed.py report --out "$OUT" | tee "$OUT/table.md"
