# s32 call 3 (ran as _scratch/s32_c3.sh; _scratch/s31_common.sh is s31_common.sh here): FP4 greedy equality with the direct kernels (tiny GPT-OSS MXFP4, tiny Qwen3-MoE NVFP4)
source _scratch/s31_common.sh
t0=$(date +%s)
timeout 420 bash benchmarks/gpu_checks.sh $OUT/eq 55,90 "mxfp4 nvfp4" > $OUT/eq.log 2>&1; echo "eq rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
finish > /dev/null
cd $OUT && tar czf all.tgz *.log eq; cat steps.log; grep -iE "identical|differ|first|PASS|FAIL|margin" eq.log | tail -30
