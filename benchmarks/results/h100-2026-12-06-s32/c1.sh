# s32 call 1 (ran as _scratch/s32_c2.sh; _scratch/s31_common.sh is s31_common.sh here): layer-call overhead split (q* parts), FP8 stock + FT fill 50% beside BF16 FT fill 25% (same GiB), trained trace; CUDA tests
source _scratch/s31_common.sh
TR=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
t0=$(date +%s)
timeout 120 python3 benchmarks/bench_layer_overhead.py --variants stock,slots,slots-neg,slots-merge,decide,decide-q,decide-q-post,lru,qstar --reduce-configs 256x1,256x2,512x2,512x4,2048x8 --out $OUT/overhead.json > $OUT/overhead.log 2>&1; echo "ovh rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
SHAPE=qwen3-30b-a3b-fp8 timeout 280 bash benchmarks/decode_matrix.sh $OUT/f8 1.0,0.5 $TR fill > $OUT/f8.log 2>&1; echo "f8 rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
finish > /dev/null
NO_STOCK=1 timeout 140 bash benchmarks/decode_matrix.sh $OUT/bf 0.25 $TR fill > $OUT/bf.log 2>&1; echo "bf rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
finish > /dev/null
timeout 90 python3 -m pytest -q -rA tests/test_gpu.py -p no:cacheprovider -k "doorbell" > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
finish > /dev/null
rm -rf $OUT/f8/*.safetensors $OUT/bf/*.safetensors 2>/dev/null
cd $OUT && tar czf all.tgz *.log *.json f8 bf; cat steps.log; tail -12 overhead.log; tail -6 f8.log bf.log; tail -5 tests.log
