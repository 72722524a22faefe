# Session 41 call 2: TRAINED routing (W4 trace) at 50/25% on one server from q*: THEN the candidate, fill, the candidate again (Session 39's next_c1.sh without its layer benchmark and the late fill, which Session 41 measured on dummy routing).
# Needs _scratch/s31_common.sh (a copy of results/h100-2026-12-07-s35/s31_common.sh) and benchmarks/results moved aside to fit the carry (keep the W4 trace).
source _scratch/s31_common.sh
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
C=qstar,--freetoken-admission,useful,--freetoken-fill-reused,valued,--freetoken-host-rates,beside
NO_STOCK=1 THEN="cand=$C fill=fill cand2=$C" timeout $((575 - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25 $T qstar > $OUT/m.log 2>&1; echo "rc=$? $SECONDS s" >> $OUT/m.log
finish > /dev/null
rm -rf $OUT/m/*.safetensors 2>/dev/null
grep "^| ft-" $OUT/m.log | sort -u; tail -2 $OUT/m.log
