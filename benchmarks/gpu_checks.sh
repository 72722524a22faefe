#!/usr/bin/env bash
# The GPU correctness checks in one go (about 5 minutes on an H200): the CUDA tests
# (tests/test_gpu.py: decision kernel, UVA fills, MoE over slots against SGLang's fused MoE,
# the CPU branch's host-function node in a CUDA graph), then BF16 greedy-token equality with
# stock SGLang under CUDA graphs for every miss policy (gpu_equality.py: fill must be
# identical; qstar and cpu report where they first differ and stock's logprob margin there),
# and the same for FP8 block experts on a tiny DeepSeek-V3.
#   bash benchmarks/gpu_checks.sh OUT_DIR [B_P,B_H]
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [B_P,B_H]}
bw=${2:-55,90}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pytest -q "$here/../tests/test_gpu.py" -p no:cacheprovider 2>&1 | tee "$out/test_gpu.log"
tests=${PIPESTATUS[0]}
python3 "$here/gpu_equality.py" --miss-policies fill,qstar,cpu --bandwidth "$bw" --prefill-checks \
  --out "$out/gpu_equality.json" 2>&1 | tee "$out/gpu_equality.log"
eq=${PIPESTATUS[0]}
# FP8 experts with block scales: stock and FreeToken serve the same FP8 checkpoint
python3 "$here/gpu_equality.py" --family deepseek_v3 --quant fp8_block --miss-policies fill,qstar,cpu \
  --bandwidth "$bw" --out "$out/gpu_equality_fp8.json" 2>&1 | tee "$out/gpu_equality_fp8.log"
fp8=${PIPESTATUS[0]}
echo "tests/test_gpu.py exit $tests, gpu_equality.py exit $eq, fp8 exit $fp8"
exit $(( tests != 0 || eq != 0 || fp8 != 0 ))
