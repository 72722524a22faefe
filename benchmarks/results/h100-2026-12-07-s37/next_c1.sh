# Prepared in Session 37 for the next device session (not run): issue 14, BF16 trained routing at 50, 25 and 10%, q* then the useful admission with the calm-gated re-miss rule (b79cddd), the useful admission alone, fill, cpu on one server (no stock: s35's 224.36 / 430.31 on an H100 machine), with the CUDA kernel check first (the gate changed the kernel). Needs _scratch/s31_common.sh (results/h100-2026-12-07-s35/), results moved aside to fit the carry; LIMIT: seconds the matrix may run.
source _scratch/s31_common.sh
timeout 90 python3 -m pytest -q -x tests/test_gpu.py -k "decide_on_cuda_matches_reference" > $OUT/gputest.log 2>&1; tail -2 $OUT/gputest.log
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
NO_STOCK=1 THEN="usereu=qstar,--freetoken-admission,useful,--freetoken-fill-reused,on useful=qstar,--freetoken-admission,useful fill=fill cpu=cpu" timeout $((${LIMIT:-585} - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25,0.1 $T qstar > $OUT/m.log 2>&1; echo rc=$? >> $OUT/m.log
finish > /dev/null
rm -rf $OUT/m/*.safetensors 2>/dev/null
grep "^|" $OUT/m.log > $OUT/tables.md
cd $OUT && tar czf all.tgz env.log mem.log gputest.log m.log m; grep "^|" m.log | tail -20; tail -3 m.log
