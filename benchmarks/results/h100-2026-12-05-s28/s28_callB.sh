source _scratch/s28_common.sh
export THEN="fill=fill ret=qstar,--freetoken-return-rule,on admit=qstar,--freetoken-admission,reuse cpu=cpu"
timeout 545 bash benchmarks/decode_matrix.sh $OUT/t 0.5,0.25,0.1 benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz qstar > $OUT/t.log 2>&1
echo rc=$? >> $OUT/t.log
finish
