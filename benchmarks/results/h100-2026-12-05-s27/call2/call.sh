source benchmarks/gpu_env.sh > $OUT/env.log 2>&1
nvidia-smi >> $OUT/env.log 2>&1; free -g >> $OUT/env.log; git log --oneline -1 >> $OUT/env.log; date -u >> $OUT/env.log
SHAPE=gpt-oss-120b STOCK_FLAGS=--moe-runner-backend,triton_kernel FT_FLAGS=--moe-runner-backend,triton,--freetoken-cache-ratio,0.5 timeout 470 bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25,0.1 "" "fill" > $OUT/matrix.log 2>&1
echo rc=$? >> $OUT/matrix.log
date -u >> $OUT/env.log
pkill -f "[s]glang.launch_server"; sleep 3
timeout 80 python benchmarks/bench_load.py --shape qwen3-30b-a3b --layers 4 --quant bf16,fp8,nvfp4 --dir /tmp/ftload --out $OUT/load.json > $OUT/load.log 2>&1
echo rc=$? >> $OUT/load.log
grep -v '^{' $OUT/matrix.log | tail -30; tail -30 $OUT/load.log
