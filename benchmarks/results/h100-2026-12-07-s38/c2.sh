# s38 call D (warm): the all-hit A/B of the null slot (qstar against qstar-filter; slots-null against slots-neg)
source _scratch/s31_common.sh
timeout 130 python3 benchmarks/bench_layer_overhead.py --variants stock,slots,slots-neg,slots-null,lru,qstar,qstar-filter --reps 30 --out $OUT/overhead.json > $OUT/overhead.log 2>&1; echo "rc=$? $SECONDS s" >> $OUT/overhead.log
finish > /dev/null
grep "^{\|^|\|rc=" $OUT/overhead.log
