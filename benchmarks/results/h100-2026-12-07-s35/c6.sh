# s35 call 6: issue 14, BF16 q* then fill and cpu, 50/25/10%, trained trace (stock ran in calls 2 and 5 on this machine)
source _scratch/s31_common.sh
NO_STOCK=1 THEN="fill=fill cpu=cpu" timeout 320 bash benchmarks/decode_matrix.sh $OUT/c 0.5,0.25,0.1 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/c.log 2>&1; echo rc=$? >> $OUT/c.log
finish > /dev/null
rm -rf $OUT/c/*.safetensors 2>/dev/null
cd $OUT && tar czf all.tgz env.log mem.log c.log c; grep "^|" c.log | tail -24; tail -2 c.log
