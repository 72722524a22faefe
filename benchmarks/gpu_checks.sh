#!/usr/bin/env bash
# The GPU correctness checks: the CUDA tests (tests/test_gpu.py: decision kernel, UVA fills,
# MoE over slots against SGLang's fused MoE, FP4 slots, the CPU branch in CUDA graphs), then
# greedy-token equality with stock SGLang under CUDA graphs (gpu_equality.py: fill must be
# identical; qstar and cpu report where they first differ and stock's logprob margin there):
# BF16 (every miss policy and the prefill variants), FP8 block experts on a tiny DeepSeek-V3,
# MXFP4 on a tiny GPT-OSS and NVFP4 on a tiny Qwen3-MoE (fill, and --freetoken-backend cpu).
#   bash benchmarks/gpu_checks.sh OUT_DIR [B_P,B_H] [PARTS]
# PARTS: space-separated, from "tests bf16 fp8 mxfp4 nvfp4" (the default: all, about 12
# minutes on a warm H200; split them over calls of 10 minutes). TESTS_K: a pytest -k filter
# for the tests part. Full logs go to OUT_DIR.
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [B_P,B_H] [PARTS]}
bw=${2:-55,90}
parts=${3:-tests bf16 fp8 mxfp4 nvfp4}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
eq="$here/gpu_equality.py"
# FP4: the Triton MoE runner (GPT-OSS would take triton_kernel, which FreeToken refuses); no
# prefill CUDA graphs, whose capture made the tiny engines' start pass 190 s (Session 22).
fp4='{"moe_runner_backend": "triton", "disable_prefill_cuda_graph": true}'
for part in $parts; do
  case $part in tests|bf16|fp8|mxfp4|nvfp4) ;;
    *) echo "gpu_checks.sh: unknown part '$part'; choose from: tests bf16 fp8 mxfp4 nvfp4" >&2
       exit 2 ;;
  esac
done
failed=()
for part in $parts; do
  case $part in
    tests) python3 -m pytest -q -rA "$here/../tests/test_gpu.py" -p no:cacheprovider \
             ${TESTS_K:+-k "$TESTS_K"} ;;
    bf16) python3 "$eq" --miss-policies fill,qstar,cpu --bandwidth "$bw" --prefill-checks \
            --out "$out/gpu_equality.json" ;;
    fp8) python3 "$eq" --family deepseek_v3 --quant fp8_block --miss-policies fill,qstar,cpu \
           --bandwidth "$bw" --out "$out/gpu_equality_fp8.json" ;;
    mxfp4) python3 "$eq" --family gpt_oss --quant mxfp4 --miss-policies fill,qstar \
             --bandwidth "$bw" --common-args "$fp4" --out "$out/gpu_equality_mxfp4.json" ;;
    nvfp4) python3 "$eq" --quant nvfp4 --miss-policies fill,qstar --bandwidth "$bw" \
             --common-args "$fp4" --out "$out/gpu_equality_nvfp4.json" ;;
  esac > "$out/$part.log" 2>&1
  rc=$?
  echo "$part: exit $rc (log $out/$part.log)"
  [ $rc -eq 0 ] || failed+=("$part")
done
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
