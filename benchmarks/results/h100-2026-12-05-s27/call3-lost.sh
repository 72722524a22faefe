source benchmarks/gpu_env.sh > $OUT/env.log 2>&1
nvidia-smi >> $OUT/env.log 2>&1; git log --oneline -1 >> $OUT/env.log; date -u >> $OUT/env.log
NO_STOCK=1 timeout 555 bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25,0.1 "" "qstar-admit=qstar,--freetoken-admission,reuse qstar-remiss=qstar,--freetoken-fill-reused,on fill" > $OUT/matrix.log 2>&1
echo rc=$? >> $OUT/matrix.log
date -u >> $OUT/env.log
pkill -f "[s]glang.launch_server"; sleep 2
grep -v '^{' $OUT/matrix.log | tail -30
