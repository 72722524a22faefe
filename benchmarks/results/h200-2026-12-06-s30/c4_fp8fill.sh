source _scratch/s30_common.sh
NO_STOCK=1 SHAPE=qwen3-30b-a3b-fp8 timeout 230 bash benchmarks/decode_matrix.sh $OUT/f 0.5,0.25 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz fill > $OUT/f.log 2>&1; echo rc=$? >> $OUT/f.log
finish
rm -rf $OUT/f/*.safetensors 2>/dev/null
NO_STOCK=1 SHAPE=qwen3-30b-a3b-fp8 CUDA_LAUNCH_BLOCKING=1 timeout 130 bash benchmarks/decode_matrix.sh $OUT/q 0.5 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/q.log 2>&1; echo rc=$? >> $OUT/q.log
finish
rm -rf $OUT/q/*.safetensors 2>/dev/null
