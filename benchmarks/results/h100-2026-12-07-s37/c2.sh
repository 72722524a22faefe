# s37 call 2: issue 13, FP8 Qwen3 shape at 10%: q* then the useful admission, fill, cpu on one server, stock beside, trained trace
source _scratch/s31_common.sh
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
SHAPE=qwen3-30b-a3b-fp8 THEN="useful=qstar,--freetoken-admission,useful fill=fill cpu=cpu" timeout 540 bash benchmarks/decode_matrix.sh $OUT/f 0.1 $T qstar > $OUT/f.log 2>&1; echo rc=$? >> $OUT/f.log
finish > /dev/null
rm -rf $OUT/f/*.safetensors 2>/dev/null
grep "^|" $OUT/f.log > $OUT/tables.md
cd $OUT && tar czf all.tgz env.log mem.log f.log f; grep "^|" f.log | tail -30; tail -3 f.log
