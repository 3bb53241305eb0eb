#!/usr/bin/env bash
# The training runs of issues 5 and 7 in one device call on one H200 (all processes share the card):
#   - the shipped default model and its all-MLA twin (bench/train_default.py, time-limited),
#   - the synthetic-task grid KDA vs Gated DeltaNet vs attention (bench/synthetic.py, time-budgeted),
#   - Kimi Linear vs the K3 switches (bench/k3_compare.py, one process per variant, same steps; alone on the card
#     they take ~2.5 minutes for 500 steps, see BENCHMARKS.md).
# Usage: bash bench/train_runs.sh OUT [MINUTES]     (OUT receives results.tgz and the default model's shards)
# Everything is bounded in time, so the call returns within about MINUTES + 2.5 minutes.
set -u
OUT=${1:?usage: bash bench/train_runs.sh OUT [MINUTES]}
MIN=${2:-5.5}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p out/k3 "$OUT"
SYN_BUDGET=$(python3 -c "print(int($MIN * 60 + 40))")
python3 bench/train_default.py --variant default --minutes "$MIN" --out out/default > out/default.log 2>&1 &
python3 bench/train_default.py --variant mla --minutes "$MIN" --out out/mla > out/mla.log 2>&1 &
python3 bench/synthetic.py --jobs 9 --time-budget "$SYN_BUDGET" --out out/synthetic.jsonl --png out/synthetic.png \
    > out/synthetic.log 2>&1 &
for v in kimi-linear attn-res k3-all; do
    python3 bench/k3_compare.py --steps 500 --warmup 50 --eval-every 100 --minutes "$MIN" --only "$v" --out "out/k3/$v" \
        > "out/k3/$v.log" 2>&1 &
done
wait
python3 bench/synthetic.py --report out/synthetic.jsonl --png out/synthetic.png > out/synthetic.md 2>&1
python3 bench/k3_compare.py --report out/k3/kimi-linear out/k3/attn-res out/k3/k3-all > out/k3.md 2>&1
nvidia-smi --query-gpu=name,memory.used --format=csv > out/gpu.txt 2>&1
cp out/default/*.safetensors "$OUT"/ 2>/dev/null
tar czf "$OUT/results.tgz" --exclude='*.safetensors' --exclude='*.pt' out
tail -n 5 out/*.log out/k3/*.log; cat out/synthetic.md out/k3.md
