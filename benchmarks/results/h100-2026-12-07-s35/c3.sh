# s35 call 3 (Session 33's next-list step 5): issue 13, GPT-OSS-120B at 25% and 10%, qstar then fill and cpu on one server, stock beside, trained trace
source _scratch/s31_common.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SHAPE=gpt-oss-120b STOCK_FLAGS=--moe-runner-backend,triton_kernel,--mem-fraction-static,0.9 FT_FLAGS=--moe-runner-backend,triton THEN="fill=fill cpu=cpu" timeout 560 bash benchmarks/decode_matrix.sh $OUT/g 0.25,0.1 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/g.log 2>&1; echo rc=$? >> $OUT/g.log
finish > /dev/null
rm -rf $OUT/g/*.safetensors 2>/dev/null
cd $OUT && tar czf all.tgz env.log mem.log g.log g; grep "^|" g.log | tail -8; tail -2 g.log
