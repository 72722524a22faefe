# call A: C executor per format (AVX-512 host), FP8 q*+admission after the fix (stock first)
source _scratch/s31_common.sh
lscpu > $OUT/lscpu.txt
for d in bf16 fp8_block mxfp4 nvfp4; do
  timeout 80 python benchmarks/bench_cpu_executor.py --pool-gb 8 --iters 200 --dtype $d --json $OUT/cpu_$d.json > $OUT/cpu_$d.log 2>&1; echo rc=$? >> $OUT/cpu_$d.log
done
SHAPE=qwen3-30b-a3b-fp8 THEN="fill=fill" timeout 360 bash benchmarks/decode_matrix.sh $OUT/f8 0.5,0.25 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz "admit=qstar,--freetoken-admission,reuse" > $OUT/f8.log 2>&1; echo rc=$? >> $OUT/f8.log
finish
rm -rf $OUT/f8/*.safetensors 2>/dev/null
