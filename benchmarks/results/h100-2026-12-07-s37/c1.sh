# s37 call 1 (prepared in Session 36 as dev-2026-12-07-s36/c1.sh, run as is with LIMIT=585): issue 14, BF16 q* then the useful admission (alone, with the re-miss rule as of 28e801d: reused misses filled in every state), fill, cpu, the re-miss rule; 50/25/10%, trained trace, one server, NO_STOCK (stock: s35 calls 2 and 5)
source _scratch/s31_common.sh
touch $OUT/gputest.log; [ -n "$SKIP_GPUTEST" ] || timeout 60 python3 -m pytest -q -x tests/test_gpu.py -k "decide_on_cuda_matches_reference" > $OUT/gputest.log 2>&1; tail -2 $OUT/gputest.log
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
NO_STOCK=1 THEN="useful=qstar,--freetoken-admission,useful fill=fill cpu=cpu usereu=qstar,--freetoken-admission,useful,--freetoken-fill-reused,on reu=qstar,--freetoken-fill-reused,on" timeout $((${LIMIT:-585} - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25,0.1 $T qstar > $OUT/m.log 2>&1; echo rc=$? >> $OUT/m.log
finish > /dev/null
rm -rf $OUT/m/*.safetensors 2>/dev/null
grep "^|" $OUT/m.log > $OUT/tables.md
cd $OUT && tar czf all.tgz env.log mem.log gputest.log m.log m; grep "^|" m.log | tail -40; tail -3 m.log
