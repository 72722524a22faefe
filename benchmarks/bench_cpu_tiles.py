"""Benchmark: the C executor's AMX tiles against its AVX512-BF16 path, by tokens per expert.

Prefill-shaped calls: ``--experts`` distinct experts drawn at random from a BF16 pool larger
than the last-level cache, each with exactly t tokens (every token of a t-row batch routed
to every expert of the call), for each t of ``--tokens``. Every path in ``--isas`` runs the
same calls in one run (tile_min 1 for the AMX paths), so the ratios are side by side. Prints
per path and t: microseconds per expert, per token-expert item (the prefill CPU share's g),
TFLOPS and the weight bytes read per second; then the ratio of each path to the first, and
the largest relative difference between the paths' outputs. Needs a CPU with AMX for "amx".
Example: ``python benchmarks/bench_cpu_tiles.py --pool-gb 4 --json OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from freetoken_sglang.cpu.executor import CpuExpertExecutor


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool-gb", type=float, default=4.0, help="host pool size in GiB")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="moe_intermediate_size")
    p.add_argument("--experts", type=int, default=32, help="distinct experts per call")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256",
                   help="comma-separated tokens per expert")
    p.add_argument("--isas", default="avx512_bf16,amx", help="paths to compare, first = base")
    p.add_argument("--iters", type=int, default=20, help="timed calls per (path, tokens)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args()
    a.tokens = [int(t) for t in a.tokens.split(",") if t]
    a.isas = [i for i in a.isas.split(",") if i]
    return a


def main():
    a = parse_args()
    H, I = a.hidden, a.inter
    expert_bytes = 3 * H * I * 2
    n = max(a.experts, int(a.pool_gb * (1 << 30) // expert_bytes))
    gen = torch.Generator().manual_seed(0)
    banks = {"w13_weight": torch.empty(n, 2 * I, H, dtype=torch.bfloat16),
             "w2_weight": torch.empty(n, H, I, dtype=torch.bfloat16)}
    for b in banks.values():  # random values, filled in slices to bound the fp32 temporary
        for i in range(0, n, 16):
            b[i:i + 16].copy_(torch.randn(b[i:i + 16].shape, generator=gen) * 0.02)
    present = [i for i in a.isas if i in CpuExpertExecutor.available_isas()]
    missing = [i for i in a.isas if i not in present]
    if missing:
        print(f"skipped (this CPU lacks them): {missing}")
    if not present:
        raise SystemExit(f"none of --isas {a.isas} runs on this CPU "
                         f"(it has {CpuExpertExecutor.available_isas()})")
    results = {"machine": platform.node(), "cpu_isas": CpuExpertExecutor.available_isas(),
               "hidden": H, "inter": I, "experts_per_call": a.experts, "pool_experts": n,
               "rows": []}
    with CpuExpertExecutor(banks, num_threads=a.threads) as ex:
        results["threads"] = ex.num_threads
        for t in a.tokens:
            x = torch.randn(t, H, generator=gen).to(torch.bfloat16)
            rows = torch.arange(t, dtype=torch.int32).repeat(a.experts)
            calls = [torch.randperm(n, generator=gen)[:a.experts].int().repeat_interleave(t)
                     for _ in range(a.iters + 2)]
            weights = torch.rand(rows.numel(), generator=gen)
            outs, row = {}, {"tokens": t}
            for isa in present:
                ex.set_isa(isa)
                if ex.tiled:
                    ex.set_tile_min(1)
                times = []
                for i, experts in enumerate(calls):
                    out = torch.zeros(t, H)
                    t0 = time.perf_counter()
                    ex.run(x, rows, experts, weights, out)
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                    if i == 0:
                        outs[isa] = out
                us = statistics.median(times) * 1e6 / a.experts
                row[isa] = {"us_per_expert": us, "us_per_item": us / t,
                            "tflops": 6 * H * I * t / us / 1e6,
                            "weight_gbs": expert_bytes / us / 1e3}
            base = outs[present[0]]
            row["max_rel_diff"] = max(
                ((o - base).abs().max() / base.abs().max()).item() for o in outs.values())
            results["rows"].append(row)
            print(f"t={t:4d} " + "  ".join(
                f"{isa}: {row[isa]['us_per_expert']:8.1f} us/expert "
                f"{row[isa]['us_per_item']:7.2f} us/item {row[isa]['tflops']:5.2f} TFLOPS "
                f"{row[isa]['weight_gbs']:6.1f} GB/s" for isa in present)
                + "  ratio " + " ".join(
                f"{row[present[0]]['us_per_expert'] / row[isa]['us_per_expert']:.2f}x"
                for isa in present[1:]) + f"  max rel diff {row['max_rel_diff']:.2e}",
                flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
