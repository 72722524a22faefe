#!/usr/bin/env bash
# The miss-policy decode matrix on the Qwen3-30B-A3B shape (dummy weights): stock SGLang and
# FreeToken at each cache ratio x miss policy, batch 1 and 4, side by side (bench_decode.py).
# B_P/B_H are measured by the first qstar server and cached for the others.
#   bash benchmarks/decode_matrix.sh OUT_DIR "0.10 0.25 0.50" [--no-stock]
# Each server loads the 54 GiB pool (about a minute with start-up): split the ratios over
# calls to stay within a 10-minute GPU call. NEW_TOKENS (default 64) tokens per request.
set -euo pipefail
out=${1:?usage: decode_matrix.sh OUT_DIR "RATIOS" [--no-stock]}
ratios=${2:-0.25}
systems=()
[ "${3:-}" = "--no-stock" ] || systems+=(--system stock:)
for r in $ratios; do
  for p in fill cpu qstar; do
    systems+=(--system "ft-${r}-${p}:--enable-freetoken,--freetoken-cache-ratio,${r},--freetoken-miss-policy,${p}")
  done
done
exec python3 "$(dirname "$0")/bench_decode.py" --new-tokens "${NEW_TOKENS:-64}" --repeats 2 --out-dir "$out" "${systems[@]}"
