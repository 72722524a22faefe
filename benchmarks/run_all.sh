#!/usr/bin/env bash
# Runs systems on the agent workloads and writes one combined table, ratios against the best
# baseline, plots, roofline and replay plots (benchmarks/run_all.py). Default: the
# Qwen3-30B-A3B shape with dummy weights, the cache at 25% of the pool.
# The five systems do not fit one 10-minute GPU call on the Qwen3-30B-A3B shape, so they run
# as two calls. Measured on the H200 (2026-11-30, session 5; each call includes 22-28 s of
# bundle check or unpack and install; per system, start to stop, start-up in brackets):
#   bash benchmarks/run_all.sh OUT --no-replay            466 s: stock-gpu 158 s (120 s, a
#       fresh machine), ft-qstar 144 s (84 s), ft-fill 122 s (60 s)
#   bash benchmarks/run_all.sh OUT2 --no-replay --systems ft-cpu,stock-offload --append OUT/runs.json
#                                                         473 s: ft-cpu 118 s (60 s),
#       stock-offload 320 s (221 s; SGLang's dummy load with --cpu-offload-gb takes 162 s)
# The second call's report is the combined table of all five (a later --systems overrides the
# default: argparse keeps the last). The five systems together take 862 s, start-ups 545 s.
# Reduced sizes: workloads scaled by 0.1 (--scale 0.1) with at most 64 decode tokens per
# request (--decode-cap 64); a 32-token decode benchmark at batch 1 and 4 per system, each
# request cut after 10 s (--decode-bench 32 --decode-bench-max-s 10); each system's
# requests get 30 s, shared out between W1, W2 and W4 (--budget-s 30; the table shows the
# cut, e.g. "5/17 (budget)"). On the H200 the FreeToken systems ran 6-8 of the 38 requests
# in that budget, stock-gpu all 38, stock-offload none (its one W1 answer was cut at 40 s).
#   bash benchmarks/run_all.sh OUT_DIR [extra run_all.py flags]
set -euo pipefail
out=${1:?usage: run_all.sh OUT_DIR [flags]}
shift
exec python3 "$(dirname "$0")/run_all.py" --shape qwen3-30b-a3b --cache-ratio 0.25 \
  --systems stock-gpu,ft-qstar,ft-fill \
  --workloads W1,W2,W4 --scale 0.1 --decode-cap 64 --decode-bench 32 --decode-bench-max-s 10 --budget-s 30 \
  --common "--attention-backend triton --sampling-backend pytorch --cuda-graph-max-bs 8 --disable-prefill-cuda-graph --max-total-tokens 65536" \
  --out-dir "$out" "$@"
