"""Session 25, dev machine: the C executor's BF16 expert call against torch's own BF16 linear
(oneDNN) on the same experts, at prefill-sized token counts (issue 12: the prefill CPU share's
compute). Distinct experts from a pool larger than the last-level cache on both sides; torch
runs one expert after another (gate-up linear, SiLU-times-up, down linear), the executor one
call over all experts. Prints us per expert and TFLOPS for each.

    python benchmarks/results/dev-2026-12-05-s25/executor_vs_onednn.py --threads 2
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from freetoken_sglang.cpu.executor import CpuExpertExecutor

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--pool-gb", type=float, default=1.0)
ap.add_argument("--experts", type=int, default=16)
ap.add_argument("--tokens", default="8,32,64,128")
ap.add_argument("--iters", type=int, default=5)
ap.add_argument("--isa", default="avx512_bf16")
a = ap.parse_args()
H, I = 2048, 512
torch.set_num_threads(a.threads)
n = int(a.pool_gb * (1 << 30) // (3 * H * I * 2))
g = torch.Generator().manual_seed(0)
w13 = (torch.randn(n, 2 * I, H, generator=g) * 0.02).bfloat16()
w2 = (torch.randn(n, H, I, generator=g) * 0.02).bfloat16()
print(f"pool {n} experts of {H} x {I}, {a.threads} threads")
with CpuExpertExecutor({"w13_weight": w13, "w2_weight": w2}, num_threads=a.threads) as ex:
    ex.set_isa(a.isa)
    for t in [int(v) for v in a.tokens.split(",")]:
        x = torch.randn(t, H, generator=g).bfloat16()
        rows = torch.arange(t, dtype=torch.int32).repeat(a.experts)
        ours, ref = [], []
        for i in range(a.iters + 1):
            sel = torch.randperm(n, generator=g)[:a.experts]
            weights = torch.ones(rows.numel())
            out = torch.zeros(t, H)
            t0 = time.perf_counter()
            ex.run(x, rows, sel.int().repeat_interleave(t), weights, out)
            t1 = time.perf_counter()
            ref_out = torch.zeros(t, H)
            for e in sel.tolist():
                gu = F.linear(x, w13[e])
                ref_out += F.linear(F.silu(gu[:, :I]) * gu[:, I:], w2[e]).float()
            t2 = time.perf_counter()
            if i:
                ours.append((t1 - t0) / a.experts)
                ref.append((t2 - t1) / a.experts)
        diff = ((out - ref_out).abs().max() / ref_out.abs().max()).item()
        for name, v in (("executor", ours), ("torch", ref)):
            us = statistics.median(v) * 1e6
            print(f"t={t:4d} {name:8s} {us:8.1f} us/expert {6 * H * I * t / us / 1e6:5.2f} TFLOPS")
        print(f"t={t:4d} max rel diff (last call) {diff:.2e}")
