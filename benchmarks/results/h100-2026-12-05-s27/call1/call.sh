source benchmarks/gpu_env.sh > $OUT/env.log 2>&1
nvidia-smi >> $OUT/env.log 2>&1; lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/env.log; free -g >> $OUT/env.log
git log --oneline -1 >> $OUT/env.log
date -u >> $OUT/env.log
SHAPE=qwen3-30b-a3b-fp8 timeout 545 bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25,0.1 "" "fill qstar" > $OUT/matrix.log 2>&1
echo rc=$? >> $OUT/matrix.log
date -u >> $OUT/env.log
pkill -f "[s]glang.launch_server"; sleep 2
grep -v '^{' $OUT/matrix.log | tail -40
