# sourced by each call: env, machine facts, a host-memory logger
source benchmarks/gpu_env.sh > $OUT/env.log 2>&1
nvidia-smi >> $OUT/env.log 2>&1; lscpu | grep -E "Model name" >> $OUT/env.log; free -g >> $OUT/env.log
( while true; do echo "$(date +%T) $(free -g | awk '/Mem:/{print "used",$3,"free",$4,"avail",$7}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)" >> $OUT/mem.log; sleep 10; done ) &
MEMLOG=$!
finish() { pkill -f "[s]glang.launch_server"; sleep 2; kill $MEMLOG 2>/dev/null; ls -la $OUT; }
