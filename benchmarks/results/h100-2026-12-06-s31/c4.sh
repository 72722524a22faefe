source _scratch/s31_common.sh
t0=$(date +%s)
timeout 200 python3 -m pytest -q -rA tests/test_gpu.py -p no:cacheprovider -k fp4 > $OUT/tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log; tail -4 $OUT/tests.log >> $OUT/steps.log
timeout 150 python3 benchmarks/bench_fp4_slots.py --out $OUT/fp4_mxfp4.json > $OUT/fp4_mxfp4.log 2>&1; echo "mx rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
timeout 120 python3 benchmarks/bench_fp4_slots.py --format nvfp4 --out $OUT/fp4_nvfp4.json > $OUT/fp4_nvfp4.log 2>&1; echo "nv rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
finish > /dev/null
cd $OUT && mkdir -p k && mv *.log *.json k/ 2>/dev/null; tar czf all.tgz k; cat k/steps.log; grep -h "^|" k/fp4_*.log
