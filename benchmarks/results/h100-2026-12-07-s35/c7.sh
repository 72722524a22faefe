# s35 call 7: issue 14, BF16 trained trace at 50%: q*, then fill, q* + the re-miss rule on one server
source _scratch/s31_common.sh
NO_STOCK=1 THEN="fill=fill reu=qstar,--freetoken-fill-reused,on" timeout 190 bash benchmarks/decode_matrix.sh $OUT/u 0.5 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/u.log 2>&1; echo rc=$? >> $OUT/u.log
finish > /dev/null
rm -rf $OUT/u/*.safetensors 2>/dev/null
cd $OUT && tar czf all.tgz env.log mem.log u.log u; grep "^|" u.log | tail -8; tail -2 u.log
