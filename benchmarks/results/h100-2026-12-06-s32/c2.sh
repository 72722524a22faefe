# s32 call 2 (ran as _scratch/s32_c1.sh; _scratch/s31_common.sh is s31_common.sh here): GPT-OSS-120B MXFP4, stock beside FreeToken (direct FP4 kernels), trained trace; 0.94 = the GiB of BF16's 25%
# expandable segments: stock's MXFP4 swizzle ran out of memory on an H100 with 5.27 GiB reserved but unallocated (s27)
source _scratch/s31_common.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SHAPE=gpt-oss-120b STOCK_FLAGS=--moe-runner-backend,triton_kernel FT_FLAGS=--moe-runner-backend,triton THEN=fill=fill timeout 560 bash benchmarks/decode_matrix.sh $OUT/g 0.94,0.5,0.25 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/g.log 2>&1; echo rc=$? >> $OUT/g.log
finish > /dev/null
rm -rf $OUT/g/*.safetensors 2>/dev/null
cd $OUT && tar czf all.tgz env.log mem.log g.log g; grep "^|" g.log | tail -12; tail -3 g.log
