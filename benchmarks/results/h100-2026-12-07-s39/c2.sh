# Session 39 call 2: the CUDA decision-kernel check (valued rule, first GPU run), then bs1/bs4 at 50% alternating fill and q*+useful+valued+beside three times each on one server (the first cell, q*, follows the warm-up).
source _scratch/s31_common.sh
timeout 100 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py -k "decide_on_cuda_matches_reference" > $OUT/gputest.log 2>&1; echo "tests rc=$? $SECONDS s" >> $OUT/gputest.log; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/gputest.log | tail -4
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
V=qstar,--freetoken-admission,useful,--freetoken-fill-reused,valued,--freetoken-host-rates,beside
NO_STOCK=1 THEN="f1=fill vb1=$V f2=fill vb2=$V f3=fill vb3=$V" timeout $((570 - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/a 0.5 $T qstar > $OUT/a.log 2>&1; echo rc=$? >> $OUT/a.log
finish > /dev/null
rm -rf $OUT/a/*.safetensors 2>/dev/null
grep "^| ft-" $OUT/a.log | sort -u; tail -2 $OUT/a.log
