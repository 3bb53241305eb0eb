#!/usr/bin/env bash
# Issue 23's GPU measurements on a host with 2 GPUs (NCCL):
#     bash bench/distributed.sh OUT            # then read the table it prints, or OUT/summary.json
#     bash bench/distributed.sh OUT --smoke    # the same path on CPU with gloo and tiny sizes (the test runs this)
#     PYTHON=.venv/bin/python bash bench/distributed.sh OUT   # ranks start with that interpreter
#     bash bench/distributed.sh OUT --one-gpu  # only what one GPU can measure (the 1-rank dp rows, a checkpoint
#                                              # written and loaded by one rank, the longest sequence)
#     bash bench/distributed.sh OUT --groups dp,ckpt   # some phase groups only (default: all)
# Groups: dp (small model, 1 and 2 GPUs), dp48 (the 48B-shaped 8 layers, 1 and 2 GPUs), ckpt (written by 2 ranks,
# loaded by 1, greedy tokens compared), cp (one 1M-token sequence over 2 ranks), longest (one GPU's longest).
# Each phase is its own torchrun launch with a hard timeout (a phase that overruns is cut, the others still run);
# inside, each phase keeps to a softer --budget-s, and rank 0 rewrites OUT/<phase>.json after every measurement.
# Hard limits in seconds (GPU, the first phase of a process includes compiling the Triton kernels): dp 120 + 60,
# dp48 120 + 80, ckpt 90 + 60 (530 + 10 s grace each: groups dp,dp48,ckpt fit one 10-minute call), cp 170,
# longest 160 (a second call: --groups cp,longest).
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
GROUPS_WANTED=dp,dp48,ckpt,cp,longest
ARGS=()                     # what the phases get: everything but --one-gpu and --groups
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE=1; ARGS+=("$1") ;;
        --one-gpu) ONE_GPU=1 ;;
        --groups) GROUPS_WANTED=${2:?--groups needs a list, e.g. dp,ckpt}; shift ;;
        *) ARGS+=("$1") ;;
    esac
    shift
done
set -- "${ARGS[@]+"${ARGS[@]}"}"
for g in ${GROUPS_WANTED//,/ }; do
    case "$g" in dp|dp48|ckpt|cp|longest) ;; *) echo "--groups: unknown group '$g' (dp, dp48, ckpt, cp, longest)" >&2; exit 2 ;; esac
done
want() { [[ ",$GROUPS_WANTED," == *",$1,"* ]]; }
WRITERS=2                   # ranks that write the checkpoint
[ "$ONE_GPU" = 1 ] && WRITERS=1

phase() {  # phase NPROC HARD_LIMIT SOFT_BUDGET NAME [args...]
    local n=$1 hard=$2 soft=$3
    shift 3
    echo "=== $* on $n rank(s), limit ${hard}s" | tee -a "$OUT/log.txt"
    timeout --kill-after=10 "$hard" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" \
        bench/distributed.py "$@" --out "$OUT" --budget-s "$soft" >>"$OUT/log.txt" 2>&1
    echo "=== exit $? after $SECONDS s in all" | tee -a "$OUT/log.txt"
}

# limits: hard and soft seconds of each phase, GPU or (--smoke) CPU
if [ "$SMOKE" = 1 ]; then L_DP1="120 60" L_DP2="120 60" L_CK="120 60" L_CP="120 60" L_LONG="120 60"
else L_DP1="120 95" L_DP2="60 40" L_DP48_1="120 90" L_DP48_2="80 60" L_CK="90 60" L_CP="170 110" L_LONG="160 160"; fi
if want dp; then
    phase 1 $L_DP1 dp "$@"
    [ "$ONE_GPU" = 1 ] || phase 2 $L_DP2 dp "$@"
fi
if want dp48; then
    phase 1 ${L_DP48_1:-$L_DP1} dp --model 48b-8l "$@"
    [ "$ONE_GPU" = 1 ] || phase 2 ${L_DP48_2:-$L_DP2} dp --model 48b-8l "$@"
fi
if want ckpt; then
    phase $WRITERS $L_CK ckpt "$@"
    phase 1 $L_CK ckpt-load "$@"
fi
if want cp && [ "$ONE_GPU" = 0 ]; then phase 2 $L_CP cp "$@"; fi
if want longest; then
    if [ "$SMOKE" = 1 ]; then
        phase 1 $L_LONG longest --simulate-oom-above 128 "$@"      # 256 "runs out of memory", 128 holds
    else
        phase 1 $L_LONG longest "$@"
    fi
fi
"$PY" bench/distributed.py report --out "$OUT" | tee "$OUT/table.md"
