# s35 call 1: q* overlap tests + A/B, BF16 fill greedy equality
source _scratch/s31_common.sh
t0=$(date +%s)
S=$OUT/summary.txt
timeout 150 python3 -m pytest -q -rA tests/test_gpu.py -p no:cacheprovider -k "qstar_decision or doorbell or decode_executor or bit_identical" > $OUT/t.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> $S
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/t.log | tail -20 >> $S
timeout 100 python3 benchmarks/bench_layer_overhead.py --variants stock,lru,qstar,qstar-overlap --out $OUT/overhead.json > $OUT/overhead.log 2>&1; echo "ovh rc=$? $(( $(date +%s) - t0 )) s" >> $S
grep "^{\|^|" $OUT/overhead.log >> $S
timeout 240 python3 benchmarks/gpu_equality.py --miss-policies fill --bandwidth 55,90 --new-tokens 32 --out $OUT/eq.json > $OUT/eq.log 2>&1; echo "eq rc=$? $(( $(date +%s) - t0 )) s" >> $S
python3 -c "
import json; d=json.load(open('$OUT/eq.json'))
for r in d['results']: print(r['miss_policy'], r['identical'], r['first_differing_token_per_prompt'], r['freetoken_stats']['hit_rate'], r['freetoken_stats']['fills'])" >> $S 2>&1
finish > /dev/null
cd $OUT; tar czf all.tgz *.log *.json 2>/dev/null; cat $S
