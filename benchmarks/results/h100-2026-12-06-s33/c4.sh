# s33 call 4: issue 14, Qwen3-30B-A3B shape BF16, trained trace, q* + admission vs fill at 50% and 25%, stock beside
source _scratch/s31_common.sh
THEN=fill=fill timeout 500 bash benchmarks/decode_matrix.sh $OUT/q 0.5,0.25 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/q.log 2>&1; echo rc=$? >> $OUT/q.log
finish > /dev/null
rm -rf $OUT/q/*.safetensors 2>/dev/null
cd $OUT && tar czf all.tgz env.log mem.log q.log q; grep "^|" q.log | tail -8; tail -2 q.log
