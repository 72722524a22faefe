# Session 39 call 1: BF16 trained routing (W4) at 50/25/10% on one server: q* first (its 50% cell follows the warm-up: not comparable), THEN the useful admission with the valued re-miss rule, the same with the host rates beside each other, with the calm-gated re-miss rule (s38's usereu), cpu, fill (last: its 10% cell is the slowest). LIMIT: seconds the call may run.
source _scratch/s31_common.sh
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
A=qstar,--freetoken-admission,useful
NO_STOCK=1 THEN="valued=$A,--freetoken-fill-reused,valued vbeside=$A,--freetoken-fill-reused,valued,--freetoken-host-rates,beside usereu=$A,--freetoken-fill-reused,on cpu=cpu fill=fill" timeout $((${LIMIT:-585} - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25,0.1 $T qstar > $OUT/m.log 2>&1; echo rc=$? >> $OUT/m.log
finish > /dev/null
rm -rf $OUT/m/*.safetensors 2>/dev/null
grep "^|" $OUT/m.log > $OUT/tables.md
cd $OUT && tar czf all.tgz env.log mem.log m.log m; grep "^|" m.log | tail -24; tail -3 m.log; grep -rh "B_P_beside\|B_H_beside" m/*.json 2>/dev/null | sort | uniq | head
