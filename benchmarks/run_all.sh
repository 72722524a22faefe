#!/usr/bin/env bash
# Runs systems on the agent workloads and writes one combined table, ratios against the best
# baseline, plots, roofline and replay plots (benchmarks/run_all.py). Default: the
# Qwen3-30B-A3B shape with dummy weights, the cache at 25% of the pool.
# The five systems do not fit one 10-minute GPU call on the Qwen3-30B-A3B shape: a server
# takes 70-160 s to start (54 GiB pool, CUDA graphs; the first server of a fresh machine
# also compiles the Triton kernels), and on the H200 (2026-11-30) three FreeToken systems
# with a 35 s budget and a 64-token decode bench took 228 s and 141 s for the first two,
# the third was cut by the call's limit. So run_all.sh runs stock-gpu, stock-offload and
# ft-qstar, and a second call
#   bash benchmarks/run_all.sh OUT2 --systems ft-fill,ft-cpu --append OUT/runs.json
# adds the other policies (a later --systems overrides the default: argparse keeps the last).
# Reduced sizes: workloads scaled by 0.1 (--scale 0.1) with at most 64 decode tokens per
# request (--decode-cap 64); a 32-token decode benchmark at batch 1 and 4 per system, each
# request cut after 10 s (--decode-bench 32 --decode-bench-max-s 10); each system's
# requests get 30 s, shared out between W1, W2 and W4 (--budget-s 30; the table shows the
# cut, e.g. "5/17 (budget)"). That this default fits one 10-minute call is an estimate,
# not yet measured.
#   bash benchmarks/run_all.sh OUT_DIR [extra run_all.py flags]
set -euo pipefail
out=${1:?usage: run_all.sh OUT_DIR [flags]}
shift
exec python3 "$(dirname "$0")/run_all.py" --shape qwen3-30b-a3b --cache-ratio 0.25 \
  --systems stock-gpu,stock-offload,ft-qstar \
  --workloads W1,W2,W4 --scale 0.1 --decode-cap 64 --decode-bench 32 --decode-bench-max-s 10 --budget-s 30 \
  --common "--attention-backend triton --sampling-backend pytorch --cuda-graph-max-bs 8 --disable-prefill-cuda-graph --max-total-tokens 65536" \
  --out-dir "$out" "$@"
