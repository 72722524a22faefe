# Prepared in Session 39 for the next device session (not run): the bs1 cells. The all-hit layer call on the host that comes (is q*'s call still the cheaper?), then trained routing at 50/25% on one server from q* (its 50% cell follows the warm-up): THEN fill, the candidate (useful admission + valued re-miss + host rates beside) twice around fill, and the candidate with --freetoken-late-fill all (its CPU runs filled after their calls: the dummy bs1 loss). Needs _scratch/s31_common.sh (results/h100-2026-12-07-s35/) and results moved aside to fit the carry; LIMIT: seconds the call may run.
source _scratch/s31_common.sh
timeout 130 python3 benchmarks/bench_layer_overhead.py --variants stock,lru,qstar,slots-null --reps 30 --out $OUT/overhead.json > $OUT/overhead.log 2>&1; echo "rc=$? $SECONDS s" >> $OUT/overhead.log
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
C=qstar,--freetoken-admission,useful,--freetoken-fill-reused,valued,--freetoken-host-rates,beside
NO_STOCK=1 THEN="cand=$C fill=fill cand2=$C late=$C,--freetoken-late-fill,all" timeout $((${LIMIT:-585} - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25 $T qstar > $OUT/m.log 2>&1; echo rc=$? >> $OUT/m.log
finish > /dev/null
rm -rf $OUT/m/*.safetensors 2>/dev/null
grep "^{\|^|\|rc=" $OUT/overhead.log | tail -8; grep "^| ft-" $OUT/m.log | sort -u; tail -2 $OUT/m.log
