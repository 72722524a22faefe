import time, torch, sys
sys.path.insert(0, "benchmarks")  # run from the repository root
from bench_cpu_executor import _quant_banks
from freetoken_sglang.cpu.executor import CpuExpertExecutor
H, I = 2048, 768
for fmt in sys.argv[1].split(","):
    b = _quant_banks(fmt, 2, H, I)
    with CpuExpertExecutor(b, num_threads=1, block_shape=[128,128] if fmt=="fp8_block" else None) as ex:
        x = torch.randn(1, H).to(torch.bfloat16); out = torch.zeros(1, H)
        args = (x, torch.zeros(1, dtype=torch.int32), torch.tensor([0], dtype=torch.int32), torch.full((1,), 0.1), out)
        for _ in range(10): ex.run(*args)
        best = 1e9
        for rep in range(3):
            t = time.perf_counter()
            for _ in range(40): ex.run(*args)
            best = min(best, (time.perf_counter() - t) / 40)
    print(fmt, "1 thread hot us/expert", round(best * 1e6, 1))
