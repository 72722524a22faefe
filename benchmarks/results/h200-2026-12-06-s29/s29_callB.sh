source _scratch/s29_common.sh
export THEN="late=qstar,--freetoken-late-fill,on fill=fill cpu=cpu admit=qstar,--freetoken-admission,reuse"
NO_STOCK=1 timeout 530 bash benchmarks/decode_matrix.sh $OUT/t 0.5,0.25,0.1 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz "al=qstar,--freetoken-admission,reuse,--freetoken-late-fill,on" > $OUT/t.log 2>&1; echo rc=$? >> $OUT/t.log
finish
rm -rf $OUT/t/*.safetensors 2>/dev/null
