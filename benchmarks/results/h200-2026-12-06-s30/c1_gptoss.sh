source _scratch/s30_common.sh
SHAPE=gpt-oss-120b STOCK_FLAGS=--moe-runner-backend,triton_kernel FT_FLAGS=--moe-runner-backend,triton THEN=fill=fill timeout 530 bash benchmarks/decode_matrix.sh $OUT/g 0.5,0.25,0.1 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/g.log 2>&1; echo rc=$? >> $OUT/g.log
finish
rm -rf $OUT/g/*.safetensors 2>/dev/null
