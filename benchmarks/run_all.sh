#!/usr/bin/env bash
# Runs every system on the agent workloads and writes one combined table, plots, roofline
# and replay plots (benchmarks/run_all.py). Default: the Qwen3-30B-A3B shape with dummy
# weights, the cache at 25% of the pool, workloads scaled to fit one 10-minute GPU call.
#   bash benchmarks/run_all.sh OUT_DIR [extra run_all.py flags]
set -euo pipefail
out=${1:?usage: run_all.sh OUT_DIR [flags]}
shift
exec python3 "$(dirname "$0")/run_all.py" --shape qwen3-30b-a3b --cache-ratio 0.25 \
  --systems stock-gpu,stock-offload,ft-qstar,ft-fill,ft-cpu \
  --workloads W1,W2,W4 --scale 0.1 --decode-cap 64 \
  --common "--attention-backend triton --sampling-backend pytorch --cuda-graph-max-bs 8 --disable-prefill-cuda-graph --max-total-tokens 65536" \
  --out-dir "$out" "$@"
