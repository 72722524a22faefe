source _scratch/s30_common.sh
timeout 90 python -m pytest -q -rA tests/test_gpu.py -k "decide or late" -p no:cacheprovider > $OUT/tests.log 2>&1; echo rc=$? >> $OUT/tests.log
SHAPE=qwen3-30b-a3b-fp8 THEN="fill=fill" timeout 330 bash benchmarks/decode_matrix.sh $OUT/f8 0.5,0.25 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz "admit=qstar,--freetoken-admission,reuse" > $OUT/f8.log 2>&1; echo rc=$? >> $OUT/f8.log
finish
rm -rf $OUT/f8/*.safetensors 2>/dev/null
timeout 130 python benchmarks/gpu_equality.py --miss-policies qstar --bandwidth 30,100 --prefill-checks late_fill,late_fill_all --new-tokens 32 --out $OUT/eq.json > $OUT/eq.log 2>&1; echo rc=$? >> $OUT/eq.log
finish
