# Prepared in Session 38 for the next device session (not run; after next_c1.sh): the null slot's A/B on calls with CPU entries. Two servers that start with q* + the useful admission + the re-miss rule at 10% (the s38 0.873 cell), the first with CPU_ENTRIES_READ_NULL_SLOT on (the default), the second with it off (sed in the device's copy); each server's first cell follows its warm-up in the same way, so the two compare with each other (not with THEN cells). Needs _scratch/s31_common.sh (results/h100-2026-12-07-s35/) and results moved aside to fit the carry.
source _scratch/s31_common.sh
T=benchmarks/results/h200-2026-12-03-s14/train/tr/trace_W4.npz
U=usereu=qstar,--freetoken-admission,useful,--freetoken-fill-reused,on
NO_STOCK=1 timeout 270 bash benchmarks/decode_matrix.sh $OUT/on 0.1 $T "$U" > $OUT/on.log 2>&1; echo rc=$? >> $OUT/on.log
pkill -f "[s]glang.launch_server"; sleep 3
sed -i 's/^CPU_ENTRIES_READ_NULL_SLOT = True/CPU_ENTRIES_READ_NULL_SLOT = False/' freetoken_sglang/execute/decode.py
grep -n "^CPU_ENTRIES_READ_NULL_SLOT" freetoken_sglang/execute/decode.py > $OUT/flag_off.txt
NO_STOCK=1 timeout $((580 - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/off 0.1 $T "$U" > $OUT/off.log 2>&1; echo rc=$? >> $OUT/off.log
finish > /dev/null
rm -rf $OUT/on/*.safetensors $OUT/off/*.safetensors 2>/dev/null
grep "^|" $OUT/on.log $OUT/off.log | head -12; tail -2 $OUT/on.log $OUT/off.log; cat $OUT/flag_off.txt
