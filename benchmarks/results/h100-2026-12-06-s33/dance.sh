# usage: bash _scratch/dance.sh out|in
cd /work/main
if [ "$1" = out ]; then
  mv benchmarks/results /tmp/results_hold && mkdir -p benchmarks/results/h200-2026-12-03-s14/train/tr && cp /tmp/results_hold/h200-2026-12-03-s14/train/tr/trace_W4.npz benchmarks/results/h200-2026-12-03-s14/train/tr/ && echo out
else
  rm -rf benchmarks/results && mv /tmp/results_hold benchmarks/results && echo in
fi
