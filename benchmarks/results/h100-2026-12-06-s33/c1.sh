# s33 call 1: FP4 GEMM path on CUDA (bit identity + speed), then MXFP4 greedy equality (dequantized required identical; direct reported)
source _scratch/s31_common.sh
t0=$(date +%s)
timeout 150 python3 -m pytest -q -rA tests/test_gpu.py -p no:cacheprovider -k "fp4" > $OUT/t.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
tail -15 $OUT/t.log
timeout 120 python3 benchmarks/bench_fp4_slots.py --out $OUT/b_mx.json --batch-sizes 1,4,16 > $OUT/b_mx.log 2>&1; echo "bench mx rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
timeout 90 python3 benchmarks/bench_fp4_slots.py --format nvfp4 --hidden 2048 --intermediate 768 --top-k 8 --out $OUT/b_nv.json --batch-sizes 1,4,16 > $OUT/b_nv.log 2>&1; echo "bench nv rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
cat $OUT/b_mx.log | tail -12; tail -12 $OUT/b_nv.log
timeout 200 bash benchmarks/gpu_checks.sh $OUT/ck 55,90 "mxfp4" > $OUT/ck.log 2>&1; echo "ck rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
finish > /dev/null
cd $OUT; tar czf all.tgz *.log *.json ck 2>/dev/null; cat steps.log; grep -E '"miss_policy"|identical|first_differing|illegal' ck.log | head -20
