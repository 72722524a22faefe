# s35 call 2: issue 14, q* (overlap on) then fill on one server, 50% and 25%, trained trace, stock beside
source _scratch/s31_common.sh
THEN="fill=fill" timeout 560 bash benchmarks/decode_matrix.sh $OUT/m 0.5,0.25 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/m.log 2>&1; echo rc=$? >> $OUT/m.log
finish > /dev/null
rm -rf $OUT/m/*.safetensors 2>/dev/null
cd $OUT && tar czf all.tgz env.log mem.log m.log m; grep "^|" m.log | tail -12; tail -2 m.log
