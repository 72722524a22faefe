source .gpu/activate.sh > $OUT/env.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv >> $OUT/env.log 2>&1; lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/env.log; date -u >> $OUT/env.log
timeout 100 python benchmarks/results/h100-2026-12-05-s26/amx_scale.py > $OUT/amx_scale.log 2>&1
echo rc=$? >> $OUT/amx_scale.log
cat $OUT/env.log $OUT/amx_scale.log | tail -30
