# s35 call 4: issue 13, FP8 Qwen3 shape at 50% and 25%, qstar then fill and cpu on one server, stock beside, trained trace
source _scratch/s31_common.sh
SHAPE=qwen3-30b-a3b-fp8 THEN="fill=fill cpu=cpu" timeout 560 bash benchmarks/decode_matrix.sh $OUT/f 0.5,0.25 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/f.log 2>&1; echo rc=$? >> $OUT/f.log
finish > /dev/null
rm -rf $OUT/f/*.safetensors 2>/dev/null
cd $OUT && tar czf all.tgz env.log mem.log f.log f; grep "^|" f.log | tail -16; tail -2 f.log
