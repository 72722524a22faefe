#!/usr/bin/env bash
# Runs systems on the agent workloads and writes one combined table, ratios against the best
# baseline, plots, roofline and replay plots (benchmarks/run_all.py). Default: the
# Qwen3-30B-A3B shape with dummy weights, the cache at 25% of the pool.
# The five systems do not fit one 10-minute GPU call on the Qwen3-30B-A3B shape (stock
# start-up alone is about 140 s), so run_all.sh runs stock-gpu, stock-offload and ft-qstar,
# and a second call
#   bash benchmarks/run_all.sh OUT2 --systems ft-fill,ft-cpu --append OUT/runs.json
# adds the other policies (a later --systems overrides the default: argparse keeps the last).
# Workloads are scaled (--scale 0.1, --decode-cap 64), each system first runs a 64-token
# decode benchmark at batch 1 and 4 (--decode-bench 64), and each system's requests are cut
# at 60 s (--budget-s 60; truncation shown in the table, e.g. "5/17 (budget)").
#   bash benchmarks/run_all.sh OUT_DIR [extra run_all.py flags]
set -euo pipefail
out=${1:?usage: run_all.sh OUT_DIR [flags]}
shift
exec python3 "$(dirname "$0")/run_all.py" --shape qwen3-30b-a3b --cache-ratio 0.25 \
  --systems stock-gpu,stock-offload,ft-qstar \
  --workloads W1,W2,W4 --scale 0.1 --decode-cap 64 --decode-bench 64 --budget-s 60 \
  --common "--attention-backend triton --sampling-backend pytorch --cuda-graph-max-bs 8 --disable-prefill-cuda-graph --max-total-tokens 65536" \
  --out-dir "$out" "$@"
