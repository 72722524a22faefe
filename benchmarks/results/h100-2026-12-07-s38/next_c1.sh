# Prepared in Session 38 for the next device session (not run): the CUDA check of the decision kernel (the valued re-miss rule's first GPU run), then BF16 trained routing at 50/25/10% on one server: q* first (its 50% cell follows the warm-up: not comparable), THEN the useful admission with the valued re-miss rule, with the calm-gated rule (s38's), alone, fill, cpu. Needs _scratch/s31_common.sh (results/h100-2026-12-07-s35/) and results moved aside to fit the carry; LIMIT: seconds the call may run.
source _scratch/s31_common.sh
timeout 100 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py -k "decide_on_cuda_matches_reference" > $OUT/gputest.log 2>&1; echo "tests rc=$? $SECONDS s" >> $OUT/gputest.log; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/gputest.log | tail -4
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
A=qstar,--freetoken-admission,useful
NO_STOCK=1 THEN="valued=$A,--freetoken-fill-reused,valued usereu=$A,--freetoken-fill-reused,on useful=$A fill=fill cpu=cpu" timeout $((${LIMIT:-585} - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25,0.1 $T qstar > $OUT/m.log 2>&1; echo rc=$? >> $OUT/m.log
finish > /dev/null
rm -rf $OUT/m/*.safetensors 2>/dev/null
grep "^|" $OUT/m.log > $OUT/tables.md
cd $OUT && tar czf all.tgz env.log mem.log gputest.log m.log m; grep "^|" m.log | tail -20; tail -3 m.log
