# Session 39 call 3: DUMMY routing (no trace) at 50/25/10% on one server: cpu first (its 50% cell follows the warm-up), THEN q*+useful+valued+beside, fill (last: its small-cache cells are the slowest).
source _scratch/s31_common.sh
V=qstar,--freetoken-admission,useful,--freetoken-fill-reused,valued,--freetoken-host-rates,beside
NO_STOCK=1 THEN="vbeside=$V fill=fill" timeout $((${LIMIT:-480} - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/d 0.5,0.25,0.1 "" cpu > $OUT/d.log 2>&1; echo rc=$? >> $OUT/d.log
finish > /dev/null
rm -rf $OUT/d/*.safetensors 2>/dev/null
grep "^| ft-" $OUT/d.log | sort -u; tail -2 $OUT/d.log
