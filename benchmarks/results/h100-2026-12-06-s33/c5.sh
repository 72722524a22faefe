# s33 call 5: FP8 Qwen3 shape all resident (1.0), fill, stock beside: the bs4 gap and stock's runner
source _scratch/s31_common.sh
SHAPE=qwen3-30b-a3b-fp8 timeout 420 bash benchmarks/decode_matrix.sh $OUT/f8 1.0 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz fill > $OUT/f8.log 2>&1; echo rc=$? >> $OUT/f8.log
finish > /dev/null
rm -rf $OUT/f8/*.safetensors 2>/dev/null
cd $OUT && grep -iE "runner|deep_?gemm|cutlass|moe_runner_backend" f8/stock.log | head -20 > runner.txt; tar czf all.tgz env.log mem.log f8.log f8 runner.txt; grep "^|" f8.log | tail -6; tail -2 f8.log; cat runner.txt | cut -c1-300
