# s37 call 3: issue 13, GPT-OSS-120B at 50%: q* then the useful admission, fill, cpu on one server, stock beside, trained trace
source _scratch/s31_common.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
SHAPE=gpt-oss-120b STOCK_FLAGS=--moe-runner-backend,triton_kernel,--mem-fraction-static,0.9 FT_FLAGS=--moe-runner-backend,triton THEN="useful=qstar,--freetoken-admission,useful fill=fill cpu=cpu" timeout 375 bash benchmarks/decode_matrix.sh $OUT/g 0.5 $T qstar > $OUT/g.log 2>&1; echo rc=$? >> $OUT/g.log
finish > /dev/null
rm -rf $OUT/g/*.safetensors 2>/dev/null
grep "^|" $OUT/g.log > $OUT/tables.md
cd $OUT && tar czf all.tgz env.log mem.log g.log g; grep "^|" g.log | tail -30; tail -3 g.log
