# Prepared in Session 40 for the next device session (not run; after next_c1/next_c2 of results/h100-2026-12-07-s39): record bench_decode's own DUMMY routing at 50% and 25% (fill, one server), so that benchmarks/policy_model.py can replay the dummy cells (Session 40 had only session 5's agent traces as a stand-in, which reproduce the bs1 50% loss but not the 25% one). The recording rewrites the trace file every step (routing_recorder.py): its tok/s are not measurements. Needs _scratch/s31_common.sh; LIMIT: seconds the call may run.
source _scratch/s31_common.sh
NO_STOCK=1 FT_FLAGS=--freetoken-record-routing,$OUT/dummy_bench_trace.npz timeout $((${LIMIT:-400} - SECONDS)) bash benchmarks/decode_matrix.sh $OUT/rec 0.5,0.25 "" fill > $OUT/rec.log 2>&1; echo rc=$? >> $OUT/rec.log
finish > /dev/null
rm -rf $OUT/rec/*.safetensors 2>/dev/null
ls -la $OUT/dummy_bench_trace.npz; tail -2 $OUT/rec.log
