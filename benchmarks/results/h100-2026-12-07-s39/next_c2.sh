# Prepared in Session 39 for the next device session (not run; after next_c1.sh): DUMMY routing at 50/25% on one server from cpu: THEN fill, the candidate, the candidate with --freetoken-late-fill all (the dummy bs1 cells: 0.984 / 0.954 of fill in Session 39).
source _scratch/s31_common.sh
C=qstar,--freetoken-admission,useful,--freetoken-fill-reused,valued,--freetoken-host-rates,beside
NO_STOCK=1 THEN="fill=fill cand=$C late=$C,--freetoken-late-fill,all" timeout $((${LIMIT:-570} - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/d 0.5,0.25 "" cpu > $OUT/d.log 2>&1; echo rc=$? >> $OUT/d.log
finish > /dev/null
rm -rf $OUT/d/*.safetensors 2>/dev/null
grep "^| ft-" $OUT/d.log | sort -u; tail -2 $OUT/d.log
