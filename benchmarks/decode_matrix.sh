#!/usr/bin/env bash
# The miss-policy decode matrix on the Qwen3-30B-A3B shape (dummy weights), side by side
# (bench_decode.py): stock SGLang, then one FreeToken server per miss policy that starts with
# the whole pool resident and is resized (POST /freetoken/cache) to each ratio in turn.
#   bash benchmarks/decode_matrix.sh OUT_DIR [RATIOS] [TRACE.npz] [POLICIES]
# RATIOS: decreasing, comma-separated (default 1.0,0.5,0.25,0.1). TRACE: replay a routing
# trace's decode rows into the MoE layers (--freetoken-replay-routing; e.g. the trained router's
# benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz). POLICIES: default
# "fill qstar cpu"; an entry LABEL=POLICY,FLAG,VALUE... adds server flags (e.g.
# qstar-rule=qstar,--freetoken-fill-reused,on). THEN: entries LABEL=POLICY[,FLAG,VALUE] that
# the last FreeToken server changes to while serving (bench_decode.py --then: back to its
# starting size, the ratios again), one start for several policies; that server must start
# with qstar or cpu (e.g. POLICIES=qstar THEN="fill=fill cpu=cpu
# admit=qstar,--freetoken-admission,reuse"). NO_STOCK=1 leaves stock out. SHAPE: a shape of
# servers.py (default qwen3-30b-a3b; e.g. qwen3-30b-a3b-fp8, gpt-oss-120b); STOCK_FLAGS and
# FT_FLAGS: comma-separated flags for stock and for every FreeToken server (GPT-OSS-120B:
# STOCK_FLAGS=--moe-runner-backend,triton_kernel: its default runner on an H200 dequantizes the
# MXFP4 experts to BF16 at load, 36 x 128 x 49.8 MB = 229 GB; FT_FLAGS=--moe-runner-backend,
# triton; give it a TRACE: on dummy weights its tokens route to a few experts per layer, and
# every cache size from 10% hit 100% in Session 27; stock ran out of GPU memory loading it
# on an H100 machine, in the MXFP4 swizzle: run it on an H200). Each server takes 1.5-3 minutes to start on a
# fresh machine plus about 30 s per ratio: split the policies over calls of 10 minutes.
set -euo pipefail
out=${1:?usage: decode_matrix.sh OUT_DIR [RATIOS] [TRACE.npz] [POLICIES]}
ratios=${2:-1.0,0.5,0.25,0.1}
trace=${3:-}
policies=${4:-fill qstar cpu}
replay=""
[ -n "$trace" ] && replay=",--freetoken-replay-routing,$trace,--freetoken-replay-phase,decode"
systems=()
[ "${NO_STOCK:-0}" = 1 ] || systems+=(--system "stock:${STOCK_FLAGS:-}")
ft_extra=${FT_FLAGS:+,$FT_FLAGS}
for p in $policies; do
  label=${p%%=*}
  spec=${p#*=}
  flags="--enable-freetoken,--freetoken-cache-ratio,1.0,--freetoken-miss-policy,${spec}"
  systems+=(--system "ft-${label}:${flags}${replay}${ft_extra}")
done
for t in ${THEN:-}; do
  systems+=(--then "ft-$t")
done
exec python3 "$(dirname "$0")/bench_decode.py" --shape "${SHAPE:-qwen3-30b-a3b}" \
  --new-tokens "${NEW_TOKENS:-64}" --repeats 2 --max-bs 4 \
  --cache-ratios "$ratios" --out-dir "$out" "${systems[@]}"
