# s33 call 7: the fill launch that remaps (lru) against the separate remap (lru-sep), then BF16 greedy equality, fill
source _scratch/s31_common.sh
t0=$(date +%s)
timeout 100 python3 benchmarks/bench_layer_overhead.py --variants stock,slots,lru,lru-sep,qstar,fill,remap --out $OUT/overhead.json > $OUT/overhead.log 2>&1; echo "ovh rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
grep "^|" $OUT/overhead.log
timeout 150 python3 benchmarks/gpu_equality.py --miss-policies fill --bandwidth 55,90 --new-tokens 32 --out $OUT/eq.json > $OUT/eq.log 2>&1; echo "eq rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/steps.log
finish > /dev/null
cd $OUT; cat steps.log; grep -E '"identical"|first_differing' eq.log | head -5; python3 -c "
import json; d=json.load(open('eq.json'))
for r in d['results']: print(r['miss_policy'], r['identical'], r['first_differing_token_per_prompt'], r['freetoken_stats']['hit_rate'], r['freetoken_stats']['fills'])" 2>&1 | tail -3
