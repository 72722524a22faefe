# s38 call B: CUDA checks of the decision kernel (calm gate) and the null slot, then BF16 trained routing at 50/25/10%: q* first (its 50% cell follows the warm-up), THEN the useful admission with the calm-gated re-miss rule, fill, cpu on one server. If the null-slot test fails, the matrix runs with CPU_ENTRIES_READ_NULL_SLOT off.
source _scratch/s31_common.sh
timeout 100 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py -k "decide_on_cuda_matches_reference or qstar_decision_beside" > $OUT/gputest.log 2>&1; rc=$?; echo "tests rc=$rc $SECONDS s" >> $OUT/gputest.log; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/gputest.log | tail -8
if [ $rc != 0 ]; then sed -i 's/^CPU_ENTRIES_READ_NULL_SLOT = True/CPU_ENTRIES_READ_NULL_SLOT = False/' freetoken_sglang/execute/decode.py; echo "NULL SLOT OFF" | tee -a $OUT/gputest.log; fi
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
NO_STOCK=1 THEN="usereu=qstar,--freetoken-admission,useful,--freetoken-fill-reused,on fill=fill cpu=cpu" timeout $((${LIMIT:-585} - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25,0.1 $T qstar > $OUT/m.log 2>&1; echo rc=$? >> $OUT/m.log
finish > /dev/null
rm -rf $OUT/m/*.safetensors 2>/dev/null
grep "^|" $OUT/m.log > $OUT/tables.md
cd $OUT && tar czf all.tgz env.log mem.log gputest.log m.log m; grep "^|" m.log | tail -14; tail -3 m.log
