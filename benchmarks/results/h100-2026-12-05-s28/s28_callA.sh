source _scratch/s28_common.sh
python _scratch/check_return_kernel.py > $OUT/check_kernel.log 2>&1; ck=$?
echo "check rc=$ck" >> $OUT/check_kernel.log
if [ $ck = 0 ]; then
  export THEN="fill=fill cpu=cpu admit=qstar,--freetoken-admission,reuse ret=qstar,--freetoken-return-rule,on"
else
  export THEN="fill=fill cpu=cpu admit=qstar,--freetoken-admission,reuse"
fi
NO_STOCK=1 timeout 530 bash benchmarks/decode_matrix.sh $OUT/d 0.5,0.25,0.1 "" qstar > $OUT/d.log 2>&1
echo rc=$? >> $OUT/d.log
finish
