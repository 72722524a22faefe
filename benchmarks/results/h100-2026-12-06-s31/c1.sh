# call 1: issue 14 doorbell fold (CUDA tests, probe, layer overhead A/B), then trained decode q* vs fill
source _scratch/s31_common.sh
t0=$(date +%s)
timeout 180 python3 -m pytest -q -rA tests/test_gpu.py -p no:cacheprovider -k "doorbell or decide or late" > "$OUT/tests.log" 2>&1
echo "tests: exit $? ($(( $(date +%s) - t0 )) s)" >> $OUT/steps.log; tail -3 "$OUT/tests.log" >> $OUT/steps.log
timeout 80 python3 _scratch/reduce_probe.py > "$OUT/reduce_probe.log" 2>&1
echo "probe: exit $? ($(( $(date +%s) - t0 )) s)" >> $OUT/steps.log
variants=stock,decide,lru,qstar,qstar-sep
timeout 130 python3 benchmarks/bench_layer_overhead.py --variants $variants --reps 30 --out "$OUT/overhead_new.json" > "$OUT/overhead_new.log" 2>&1
echo "bench new: exit $? ($(( $(date +%s) - t0 )) s)" >> $OUT/steps.log
old=/tmp/ft_old
rm -rf $old && mkdir -p $old && tar xf _scratch/doorbell_old.tar -C $old
ln -s $old/kernels $old/freetoken_sglang/kernels
ln -s $old/patches $old/freetoken_sglang/patches
so=$(python3 -c "import freetoken_sglang._cpu_executor as m; print(m.__file__)")
cp "$so" $old/freetoken_sglang/
repo=$PWD
(cd /tmp && PYTHONPATH=$old:${PYTHONPATH:-} python3 -c "import freetoken_sglang.kernels.doorbell as d; assert not hasattr(d, 'reduce_merge') and d.__file__.startswith('$old'), d.__file__" \
  && PYTHONPATH=$old:${PYTHONPATH:-} timeout 130 python3 $repo/benchmarks/bench_layer_overhead.py --variants $variants --reps 30 --out "$OUT/overhead_old.json") > "$OUT/overhead_old.log" 2>&1
echo "bench old: exit $? ($(( $(date +%s) - t0 )) s)" >> $OUT/steps.log
THEN="fill=fill admit=qstar,--freetoken-admission,reuse" NO_STOCK=1 timeout 300 bash benchmarks/decode_matrix.sh $OUT/t 0.5,0.25 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/t.log 2>&1; echo rc=$? >> $OUT/t.log
echo "matrix: ($(( $(date +%s) - t0 )) s)" >> $OUT/steps.log
finish
rm -rf $OUT/t/*.safetensors 2>/dev/null
