# python benchmarks/results/dev-2026-12-06-s30/bit_identical.py OUT.pt with each build (the old one: PYTHONPATH=<checkout of 0447feb, its executor built>), then compare the two files (bit_identical.out)
import torch, sys
sys.path.insert(0, "benchmarks")  # run from the repository root
from bench_cpu_executor import _quant_banks
from freetoken_sglang.cpu.executor import CpuExpertExecutor
torch.manual_seed(0)
res = {}
for fmt in ["fp8_block", "mxfp4", "nvfp4"]:
    for (H, I) in [(256, 128), (224, 96), (2048, 768)] + ([(208, 80)] if fmt == "fp8_block" else [(208, 80)] if fmt=="nvfp4" else []):
        torch.manual_seed(1)
        banks = _quant_banks(fmt, 3, H, I)
        for T in (1, 2, 4):
            x = torch.randn(T, H).to(torch.bfloat16)
            with CpuExpertExecutor(banks, num_threads=1, isa="avx2", block_shape=[128, 128] if fmt == "fp8_block" else None) as ex:
                out = torch.zeros(T, H)
                rows = torch.tensor([t for t in range(T) for _ in range(2)], dtype=torch.int32)
                ex.run(x, rows, torch.tensor([(t + j) % 3 for t in range(T) for j in range(2)], dtype=torch.int32), torch.rand(2 * T), out)
            res[(fmt, H, I, T)] = out
torch.save(res, sys.argv[1])
