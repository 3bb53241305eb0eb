#!/bin/bash
# decode GEMV A/B on the H200: `bash bench/gemv_ab.sh` with fla-core's wheel in .whl/ (carry .whl); EXPERIMENT, goes with the switch
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
echo "=== gemv bench"
timeout 240 python3 bench/gemv_gpu.py --sweep 2>&1 | tee $OUT/gemv.log | grep -v -i warn
for round in 1 2; do
 for c in 0 1; do
  echo "=== KL_GEMV=$c 131072 round $round"
  KL_GEMV=$c timeout 90 python3 bench/profile_decode.py --batches 1 --context 131072 --top 14 2>&1 | tee -a $OUT/prof.log | grep -v -i warn
 done
done
for c in 0 1; do
  echo "=== KL_GEMV=$c 4096"
  KL_GEMV=$c timeout 80 python3 bench/profile_decode.py --batches 1 --context 4096 --top 8 2>&1 | tee -a $OUT/prof.log | grep -v -i warn
done
