source _scratch/s30_common.sh
export THEN="fill=fill admit=qstar,--freetoken-admission,reuse all=qstar,--freetoken-late-fill,all cpu=cpu"
NO_STOCK=1 timeout 420 bash benchmarks/decode_matrix.sh $OUT/t 0.5,0.25,0.1 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz "aa=qstar,--freetoken-admission,reuse,--freetoken-late-fill,all" > $OUT/t.log 2>&1; echo rc=$? >> $OUT/t.log
finish
rm -rf $OUT/t/*.safetensors 2>/dev/null
finish
