# s33 call 2: GPT-OSS-120B stock (expandable segments, --mem-fraction-static 0.9) beside FreeToken fill at 0.94 (the GiB of BF16's 25%), trained trace
source _scratch/s31_common.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SHAPE=gpt-oss-120b STOCK_FLAGS=--moe-runner-backend,triton_kernel,--mem-fraction-static,0.9 FT_FLAGS=--moe-runner-backend,triton timeout 540 bash benchmarks/decode_matrix.sh $OUT/g 0.94,0.5 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz fill > $OUT/g.log 2>&1; echo rc=$? >> $OUT/g.log
finish > /dev/null
rm -rf $OUT/g/*.safetensors 2>/dev/null
cd $OUT && tar czf all.tgz env.log mem.log g.log g; grep "^|" g.log | tail -5; tail -2 g.log
