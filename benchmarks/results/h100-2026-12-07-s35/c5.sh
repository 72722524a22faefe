# s35 call 5: issue 14, all resident (1.0), q* then fill on one server, trained trace, stock beside
source _scratch/s31_common.sh
THEN="fill=fill" timeout 400 bash benchmarks/decode_matrix.sh $OUT/r 1.0 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/r.log 2>&1; echo rc=$? >> $OUT/r.log
finish > /dev/null
rm -rf $OUT/r/*.safetensors 2>/dev/null
cd $OUT && tar czf all.tgz env.log mem.log r.log r; grep "^|" r.log | tail -10; tail -2 r.log
