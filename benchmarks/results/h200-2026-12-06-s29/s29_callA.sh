source _scratch/s29_common.sh
timeout 120 python -m pytest -q -rA tests/test_gpu.py -k "decide or late or q_table" -p no:cacheprovider > $OUT/tests.log 2>&1; echo rc=$? >> $OUT/tests.log
export THEN="fill=fill al=qstar,--freetoken-admission,reuse,--freetoken-late-fill,on"
NO_STOCK=1 timeout 400 bash benchmarks/decode_matrix.sh $OUT/d 0.5,0.25,0.1 "" "late=qstar,--freetoken-late-fill,on" > $OUT/d.log 2>&1; echo rc=$? >> $OUT/d.log
finish
rm -rf $OUT/d/*.safetensors 2>/dev/null
