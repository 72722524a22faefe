# Source on the GPU machine from the repository root, with the SGLang bundle and activate.sh
# of ../shared/gpu/ copied into the ignored .gpu/ (../shared/gpu/README.md):
#   source benchmarks/gpu_env.sh
# Unpacks the bundle, installs this checkout (editable, no index there), and makes the plugin's
# `sglang.srt.plugins` entry point and the checkout importable (an editable install alone left
# the entry point unseen there, and the checkout off the path of subprocesses).
ulimit -l unlimited
echo "ulimit -l: $(ulimit -l)"
source .gpu/activate.sh
pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -v "root' user" | tail -3
_ft_ep=/tmp/ftdist/freetoken_ep-0.dist-info
mkdir -p "$_ft_ep"
printf 'Metadata-Version: 2.1\nName: freetoken-ep\nVersion: 0\n' > "$_ft_ep/METADATA"
printf '[sglang.srt.plugins]\nfreetoken = freetoken_sglang.plugin:register\n' > "$_ft_ep/entry_points.txt"
export PYTHONPATH=$PWD:/tmp/ftdist:$PYTHONPATH
python3 -c "from importlib.metadata import entry_points; print('plugins:', [e.name for e in entry_points(group='sglang.srt.plugins')]); import freetoken_sglang.kernels.residency"
nvidia-smi --query-gpu=memory.used,memory.free --format=csv
