# s34 call 1: decision A/B (relaxed counters, hoisted loads, overlap with the alignment), CUDA tests, FP8 at 50% vs stock, BF16 fill equality
source _scratch/s31_common.sh
t0=$(date +%s)
S=$OUT/summary.txt
timeout 100 python3 benchmarks/bench_layer_overhead.py --variants stock,slots,decide,decide-full,decide-acqrel,fill,lru,lru-seq,lru-sep,qstar --out $OUT/overhead.json > $OUT/overhead.log 2>&1; echo "ovh rc=$? $(( $(date +%s) - t0 )) s" >> $S
grep "^{\|^|" $OUT/overhead.log >> $S
timeout 110 python3 -m pytest -q -rA tests/test_gpu.py -p no:cacheprovider -k "decode_executor or bit_identical or decide or doorbell" > $OUT/t.log 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> $S
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/t.log | tail -20 >> $S
SHAPE=qwen3-30b-a3b-fp8 timeout 200 bash benchmarks/decode_matrix.sh $OUT/f8 0.5 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz fill > $OUT/f8.log 2>&1; echo "f8 rc=$? $(( $(date +%s) - t0 )) s" >> $S
pkill -f "[s]glang.launch_server"; sleep 2
rm -rf $OUT/f8/*.safetensors 2>/dev/null
grep "^|" $OUT/f8.log | tail -6 >> $S; grep -h "hit_rate\|B_P\|B_H" $OUT/f8.log | tail -4 >> $S
timeout 150 python3 benchmarks/gpu_equality.py --miss-policies fill --bandwidth 55,90 --new-tokens 32 --out $OUT/eq.json > $OUT/eq.log 2>&1; echo "eq rc=$? $(( $(date +%s) - t0 )) s" >> $S
python3 -c "
import json; d=json.load(open('$OUT/eq.json'))
for r in d['results']: print(r['miss_policy'], r['identical'], r['first_differing_token_per_prompt'], r['freetoken_stats']['hit_rate'], r['freetoken_stats']['fills'])" >> $S 2>&1
finish > /dev/null
cd $OUT; tar czf all.tgz *.log *.json f8 2>/dev/null; cat $S
