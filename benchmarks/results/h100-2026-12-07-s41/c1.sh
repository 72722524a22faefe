# Session 41 call 1: DUMMY routing at 50/25% on one server from cpu: THEN fill, the candidate, the candidate with --freetoken-late-fill all (Session 39's next_c2.sh), then the all-hit layer call (next_c1.sh's first step) with the time left.
source _scratch/s31_common.sh
C=qstar,--freetoken-admission,useful,--freetoken-fill-reused,valued,--freetoken-host-rates,beside
NO_STOCK=1 THEN="fill=fill cand=$C late=$C,--freetoken-late-fill,all" timeout 420 bash benchmarks/decode_matrix.sh $OUT/d 0.5,0.25 "" cpu > $OUT/d.log 2>&1; echo "rc=$? $SECONDS s" >> $OUT/d.log
pkill -f "[s]glang.launch_server"; sleep 2
grep "^| ft-" $OUT/d.log | sort -u; tail -2 $OUT/d.log
R=$((575 - SECONDS)); [ $R -gt 60 ] && { timeout $R python3 benchmarks/bench_layer_overhead.py --variants stock,lru,qstar,slots-null --reps 30 --out $OUT/overhead.json > $OUT/overhead.log 2>&1; echo "rc=$? $SECONDS s" >> $OUT/overhead.log; grep "^{\|^|\|rc=" $OUT/overhead.log | tail -8; }
finish > /dev/null
rm -rf $OUT/d/*.safetensors 2>/dev/null
