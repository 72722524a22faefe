# s33 call 3: MXFP4 and NVFP4 greedy equality (dequantized required identical; direct reported)
source _scratch/s31_common.sh
t0=$(date +%s)
timeout 300 bash benchmarks/gpu_checks.sh $OUT/ck 55,90 "mxfp4" > $OUT/ck.log 2>&1; echo "ck mx rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
finish > /dev/null
timeout 250 bash benchmarks/gpu_checks.sh $OUT/ck 55,90 "nvfp4" > $OUT/ck2.log 2>&1; echo "ck nv rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
finish > /dev/null
cd $OUT; tar czf all.tgz *.log ck 2>/dev/null; cat steps.log; grep -E '"miss_policy"|identical|first_differing|illegal' ck.log ck2.log | head -30
