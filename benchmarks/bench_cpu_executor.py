"""Benchmark: the C expert executor's effective bandwidth vs a STREAM-like read of the pool.

Builds a host expert pool of the given size (default: the Qwen3-30B-A3B expert shape, hidden
2048, moe_intermediate 768, BF16, 9.4 MiB per expert; ``--dtype fp8_block|mxfp4|nvfp4``: random
codes and scales of that format in the executor's layouts, scales counted in the bytes), then
measures in one run, with one thread pool:

- ``stream``: every compute thread reads its share of the whole pool once per pass (plain
  SIMD loads and integer adds, no arithmetic on the weights): the machine's read bandwidth;
- decode-like calls (1 token with 1, 3, or 2-8 random missed experts) and batch-4 calls
  (4 tokens, 2-8 random experts each), run through a task descriptor as the graph-resident
  host callback does, and through ``CpuExpertExecutor.run`` (Python checks included).

Effective bandwidth = bytes of the distinct experts a call reads / its wall time. The pool is
far larger than the last-level cache and experts are drawn at random, so weights come from
DRAM. Example: ``python benchmarks/bench_cpu_executor.py --pool-gb 1.5 --iters 100``.

``--schedules dynamic,static --busy N`` compares how the executor shares a call's work
between its threads (chunks from a counter, or one fixed share per thread) on an idle
machine and with N other processes spinning on the CPU, as in a server, where the
scheduler's thread spins while it waits for the GPU: every scenario runs under each
(schedule, load) pair in one run, and a second table gives the ratios to the first schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from freetoken_sglang.cpu.executor import CpuExpertExecutor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MIB = 1 << 20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool-gb", type=float, default=2.0, help="host pool size in GiB")
    p.add_argument(
        "--threads", type=int, default=None, help="compute threads (default: physical cores)"
    )
    p.add_argument("--iters", type=int, default=100, help="timed calls per scenario")
    p.add_argument("--stream-passes", type=int, default=5, help="timed full-pool reads")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="moe_intermediate_size")
    p.add_argument("--dtype", choices=sorted(DTYPES) + list(QUANT), default="bf16",
                   help="expert weights: dense, or a quantized format (random codes)")
    p.add_argument(
        "--isa", default="auto",
        help="kernel path (auto, portable, avx2, avx512, avx512_bf16, amx, amx_emulated)"
    )
    p.add_argument("--spin-us", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", default="dynamic",
                   help="comma-separated work schedules to compare: dynamic, static")
    p.add_argument("--busy", type=int, default=0,
                   help="also measure with this many busy-spinning processes (0: idle only)")
    p.add_argument("--busy-cpus", default=None,
                   help="comma-separated CPUs the busy processes are bound to (default: any); "
                        "worker i of the executor is pinned to the i-th CPU of its ordered "
                        "list (one per physical core), so e.g. 1 slows one worker")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    a = p.parse_args()
    a.schedules = [x for x in a.schedules.split(",") if x]
    if not a.schedules or any(x not in ("dynamic", "static") for x in a.schedules):
        p.error("--schedules takes dynamic and/or static")
    if a.busy < 0:
        p.error("--busy must be >= 0")
    a.busy_cpus = [int(c) for c in a.busy_cpus.split(",")] if a.busy_cpus else None
    return a


def _spin(cpus=None):
    if cpus:
        os.sched_setaffinity(0, cpus)
    while True:
        pass


class BusyProcesses:
    """``n`` processes that spin on the CPU while the block runs (another busy thread on a
    worker's core, as a server's scheduler thread waiting on the GPU is)."""

    def __init__(self, n: int, cpus=None):
        self.n, self.cpus, self.procs = n, cpus, []

    def __enter__(self):
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self.procs = [ctx.Process(target=_spin, args=(self.cpus,), daemon=True)
                      for _ in range(self.n)]
        for proc in self.procs:
            proc.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.join()


QUANT = ("fp8_block", "mxfp4", "nvfp4")
FP8_BLOCK = [128, 128]


def _quant_banks(fmt, n, hidden, inter):
    """Random codes and scales of a quantized pool in the executor's layouts
    (``CpuExpertExecutor``): FP8 e4m3 with 128x128 fp32 block scales, or packed e2m1 with e8m0
    scales per 32 (MXFP4) or e4m3 scales per 16 and fp32 global scales (NVFP4); no NaN."""
    up = 2 * inter
    if fmt == "fp8_block":
        bn, bk = FP8_BLOCK
        banks = {"w13_weight": torch.empty(n, up, hidden, dtype=torch.float8_e4m3fn),
                 "w2_weight": torch.empty(n, hidden, inter, dtype=torch.float8_e4m3fn)}
        for b in banks.values():  # in slabs: no fp32 copy of the whole pool
            for i in range(0, n, 64):
                b[i:i + 64] = torch.empty(b[i:i + 64].shape).uniform_(-400, 400)
        banks["w13_weight_scale_inv"] = torch.rand(n, -(-up // bn), -(-hidden // bk)) * 1e-4
        banks["w2_weight_scale_inv"] = torch.rand(n, -(-hidden // bn), -(-inter // bk)) * 1e-4
        return banks
    group = 32 if fmt == "mxfp4" else 16
    banks = {"w13_weight": torch.randint(0, 256, (n, up, hidden // 2), dtype=torch.uint8),
             "w2_weight": torch.randint(0, 256, (n, hidden, inter // 2), dtype=torch.uint8)}
    if fmt == "mxfp4":
        banks["w13_weight_scale"] = torch.randint(118, 124, (n, up, hidden // group),
                                                  dtype=torch.uint8)
        banks["w2_weight_scale"] = torch.randint(118, 124, (n, hidden, inter // group),
                                                 dtype=torch.uint8)
    else:
        banks["w13_weight_scale"] = torch.empty(n, up, hidden // group).uniform_(
            0.5, 2).to(torch.float8_e4m3fn)
        banks["w2_weight_scale"] = torch.empty(n, hidden, inter // group).uniform_(
            0.5, 2).to(torch.float8_e4m3fn)
        banks["w13_weight_scale_2"] = torch.full((n, 2), 1e-2)
        banks["w2_weight_scale_2"] = torch.full((n,), 1e-2)
    return banks


def build_pool(args):
    if args.dtype in QUANT:
        one = _quant_banks(args.dtype, 1, args.hidden, args.inter)
        expert_bytes = sum(b.numel() * b.element_size() for b in one.values())
    else:
        dtype = DTYPES[args.dtype]
        esz = torch.empty((), dtype=dtype).element_size()
        expert_bytes = 3 * args.hidden * args.inter * esz
    n = int(args.pool_gb * (1 << 30)) // expert_bytes
    if n < 8:
        raise SystemExit(f"--pool-gb {args.pool_gb} holds {n} experts; need at least 8")
    if args.dtype in QUANT:
        return _quant_banks(args.dtype, n, args.hidden, args.inter), n, expert_bytes
    banks = {
        "w13_weight": torch.empty(n, 2 * args.inter, args.hidden, dtype=dtype),
        "w2_weight": torch.empty(n, args.hidden, args.inter, dtype=dtype),
    }
    for bank in banks.values():
        bank.uniform_(-0.05, 0.05)  # touches every page; no NaN or subnormal values
    return banks, n, expert_bytes


def make_calls(gen, scenario, iters, n_experts):
    """A list of (tokens, rows, flat expert ids) per call, experts drawn at random from the
    whole pool (distinct within a token)."""
    calls = []
    for _ in range(iters):
        if scenario.startswith("batch4"):
            tokens, rows, ids = 4, [], []
            for t in range(tokens):
                m = int(torch.randint(2, 9, (1,), generator=gen))
                rows += [t] * m
                ids += torch.randperm(n_experts, generator=gen)[:m].tolist()
        else:
            m = {"decode m=1": 1, "decode m=3": 3}.get(scenario)
            if m is None:
                m = int(torch.randint(2, 9, (1,), generator=gen))
            tokens, rows = 1, [0] * m
            ids = torch.randperm(n_experts, generator=gen)[:m].tolist()
        calls.append((tokens, rows, ids))
    return calls


def time_scenario(ex, calls, hidden, expert_bytes, gen, use_task):
    """Total bytes, total seconds, and per-call (microseconds, GB/s) of the calls."""
    cap = max(len(r) for _, r, _ in calls)
    x = torch.randn(4, hidden, generator=gen).to(torch.bfloat16)
    out = torch.zeros(4, hidden)
    rows = torch.zeros(cap, dtype=torch.int32)
    experts = torch.zeros(cap, dtype=torch.int32)
    weights = torch.rand(cap, generator=gen)
    task = ex.make_task(
        x_ptr=x.data_ptr(),
        x_dtype=x.dtype,
        n_rows=4,
        rows_ptr=rows.data_ptr(),
        experts_ptr=experts.data_ptr(),
        weights_ptr=weights.data_ptr(),
        out_ptr=out.data_ptr(),
    )
    total_bytes, total_s, per_call = 0, 0.0, []
    for tokens, r, ids in calls:
        n = len(r)
        rows[:n] = torch.tensor(r, dtype=torch.int32)
        experts[:n] = torch.tensor(ids, dtype=torch.int32)
        if use_task:
            task.n_items = n
            t0 = time.perf_counter()
            task.run()
            dt = time.perf_counter() - t0
        else:
            xs, rs, es, ws, os_ = x[:tokens], rows[:n], experts[:n], weights[:n], out[:tokens]
            t0 = time.perf_counter()
            ex.run(xs, rs, es, ws, os_)
            dt = time.perf_counter() - t0
        nbytes = len(set(ids)) * expert_bytes
        total_bytes += nbytes
        total_s += dt
        per_call.append((dt * 1e6, nbytes / dt / 1e9))
    return total_bytes, total_s, per_call


def main():
    args = parse_args()
    t_build = time.perf_counter()
    banks, n_experts, expert_bytes = build_pool(args)
    pool_bytes = sum(b.numel() * b.element_size() for b in banks.values())
    build_s = time.perf_counter() - t_build
    gen = torch.Generator().manual_seed(args.seed)
    results = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "logical_cpus": len(os.sched_getaffinity(0)),
            "physical_cores": CpuExpertExecutor.physical_cores(),
            "isas": CpuExpertExecutor.available_isas(),
        },
        "pool": {
            "gib": pool_bytes / (1 << 30),
            "experts": n_experts,
            "expert_mib": expert_bytes / MIB,
            "hidden": args.hidden,
            "inter": args.inter,
            "dtype": args.dtype,
            "build_s": build_s,
        },
        "scenarios": [],
    }
    with CpuExpertExecutor(
        banks, num_threads=args.threads, isa=args.isa, spin_us=args.spin_us,
        block_shape=FP8_BLOCK if args.dtype == "fp8_block" else None,
    ) as ex:
        results["threads"] = ex.num_threads
        results["busy_cpus"] = args.busy_cpus
        results["pinned"] = ex.num_pinned
        results["isa"] = ex.isa
        # STREAM-like reference: whole-pool reads with the same thread pool.
        stream = []
        for i in range(args.stream_passes + 1):
            t0 = time.perf_counter()
            for bank in banks.values():
                ex.stream_read(bank)
            dt = time.perf_counter() - t0
            if i:  # the first pass warms up
                stream.append(pool_bytes / dt / 1e9)
        stream_gbs = statistics.median(stream)
        results["stream_gbs"] = stream_gbs
        results["stream_passes_gbs"] = stream
        scenarios = ("decode m=1", "decode m=3", "decode m=2-8", "batch4 m=2-8")
        # The same calls under every (load, schedule), so that the ratios compare like with like.
        all_calls = {sc: make_calls(gen, sc, args.iters, n_experts) for sc in scenarios}
        for busy in ([0, args.busy] if args.busy else [0]):
            with BusyProcesses(busy, args.busy_cpus):
                for schedule in args.schedules:
                    ex.set_schedule(schedule)
                    for scenario in scenarios:
                        calls = all_calls[scenario]
                        time_scenario(ex, calls[: max(3, args.iters // 10)], args.hidden,
                                      expert_bytes, gen, True)
                        b, s, per_call = time_scenario(ex, calls, args.hidden, expert_bytes,
                                                       gen, True)
                        b2, s2, _ = time_scenario(ex, calls, args.hidden, expert_bytes, gen,
                                                  False)
                        results["scenarios"].append({
                            "name": scenario,
                            "schedule": schedule,
                            "busy": busy,
                            "calls": len(calls),
                            "mib_per_call": b / len(calls) / MIB,
                            "median_us": statistics.median(us for us, _ in per_call),
                            "task_gbs": b / s / 1e9,
                            "task_median_call_gbs": statistics.median(g for _, g in per_call),
                            "run_gbs": b2 / s2 / 1e9,
                            "ratio_vs_stream": b / s / 1e9 / stream_gbs,
                            "median_call_ratio_vs_stream":
                                statistics.median(g for _, g in per_call) / stream_gbs,
                        })

    m, p = results["machine"], results["pool"]
    print(
        f"{m['cpu']}: {m['physical_cores']} physical cores, {m['logical_cpus']} logical; "
        f"paths {m['isas']}; executor isa={results['isa']}, threads={results['threads']} "
        f"({results['pinned']} workers pinned)"
    )
    print(
        f"pool {p['gib']:.2f} GiB = {p['experts']} experts of {p['expert_mib']:.2f} MiB "
        f"({p['dtype']}, H={p['hidden']}, I={p['inter']}), filled in {p['build_s']:.1f} s"
    )
    print(f"stream read (whole pool, {args.stream_passes} passes, median): {stream_gbs:.2f} GB/s\n")
    head = (
        f"{'scenario':<14} {'schedule':>8} {'busy':>4} {'calls':>5} {'MiB/call':>9} {'median us':>10} {'task GB/s':>10} "
        f"{'median-call GB/s':>17} {'run() GB/s':>11} {'task/stream':>12} {'median/stream':>14}"
    )
    print(head)
    print("-" * len(head))
    for r in results["scenarios"]:
        print(
            f"{r['name']:<14} {r['schedule']:>8} {r['busy']:>4} {r['calls']:>5} {r['mib_per_call']:>9.1f} {r['median_us']:>10.0f} "
            f"{r['task_gbs']:>10.2f} {r['task_median_call_gbs']:>17.2f} {r['run_gbs']:>11.2f} "
            f"{100 * r['ratio_vs_stream']:>11.0f}% {100 * r['median_call_ratio_vs_stream']:>13.0f}%"
        )
    print(
        "\ntask GB/s: all bytes / all time of the calls through a task descriptor (the host-"
        "callback path);\nmedian-call GB/s: the median call's bytes / time; run() GB/s: the same "
        "calls through CpuExpertExecutor.run."
    )
    if len(args.schedules) > 1:
        first = args.schedules[0]
        base = {(r["name"], r["busy"]): r["task_gbs"] for r in results["scenarios"]
                if r["schedule"] == first}
        print(f"\ntask GB/s relative to {first}, same scenario and load:")
        print(f"{'scenario':<14} {'busy':>4} " + " ".join(f"{x:>9}" for x in args.schedules))
        for (name, busy), g0 in base.items():
            cells = [next(r["task_gbs"] for r in results["scenarios"] if r["name"] == name
                          and r["busy"] == busy and r["schedule"] == x) / g0
                     for x in args.schedules]
            print(f"{name:<14} {busy:>4} " + " ".join(f"{c:>9.3f}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
