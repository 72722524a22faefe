"""Benchmark: host memory read by PCIe copies and by the CPU at once (the bound of a prefill that
must read every non-resident expert, paper §3.2 Eq. 2).

Three timed windows of ``--seconds`` each: pinned host-to-GPU copies alone (chunks of
``--chunk-mib`` from a pinned buffer, as streamed prefill copies layers), the C executor's
STREAM-like read alone (``CpuExpertExecutor.stream_read`` over slices of a second pinned
buffer, as the executor reads the pinned pool), then both at once (the copies issued from a
Python thread while the read runs; cffi releases the GIL). The copy thread waits on blocking
CUDA events, and the executor gets one core fewer than the machine has (``--threads``, default
cores - 1), so the together window does not oversubscribe the cores. Each rate is bytes over
its own thread's time, and both threads stop within one chunk or slice of the window's end.
Prints GB/s of each side alone and together and their sum, the rate at which a prefill can take
in non-resident expert bytes when PCIe and the CPU share the work; with ``--bytes-gb B``
(e.g. 48.32: the 7680 non-resident 6 MiB experts of the Qwen3.6-35B-A3B shape at 25%), B over
that sum, the least time any split of B between the two can take. Needs a CUDA GPU.

    python benchmarks/bench_host_concurrency.py --buffer-gib 8 --seconds 3 --bytes-gb 48.32 \\
        --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

from freetoken_sglang.cpu.executor import CpuExpertExecutor


def copies(src: torch.Tensor, dst: torch.Tensor, chunk: int, stop: threading.Event,
           out: dict):
    """Copy ``src`` into ``dst`` chunk by chunk until ``stop``; bytes and seconds in ``out``.
    At most 8 chunks in flight; the wait blocks (no spinning core)."""
    n, done, k, i, t0 = src.numel(), 0, 0, 0, time.perf_counter()
    while not stop.is_set():
        j = min(i + chunk, n)
        dst[: j - i].copy_(src[i:j], non_blocking=True)
        done, k = done + j - i, k + 1
        i = 0 if j == n else j
        if k % 8 == 0:
            ev = torch.cuda.Event(blocking=True)
            ev.record()
            ev.synchronize()
    ev = torch.cuda.Event(blocking=True)
    ev.record()
    ev.synchronize()
    out["bytes"], out["s"] = done, time.perf_counter() - t0


def reads(ex: CpuExpertExecutor, slices, stop: threading.Event, out: dict):
    """Reads of ``slices`` in turn with the executor's threads until ``stop``."""
    done, k, t0 = 0, 0, time.perf_counter()
    while not stop.is_set():
        s = slices[k % len(slices)]
        ex.stream_read(s)
        done, k = done + s.numel(), k + 1
    out["bytes"], out["s"] = done, time.perf_counter() - t0


def window(seconds: float, parts) -> list:
    """Run each ``(fn, args)`` in its own thread for ``seconds``: GB/s of each."""
    stop, outs, threads = threading.Event(), [], []
    for fn, args in parts:
        outs.append({})
        threads.append(threading.Thread(target=fn, args=(*args, stop, outs[-1]), daemon=True))
    try:
        for t in threads:
            t.start()
        time.sleep(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join()
    if any("bytes" not in o for o in outs):
        raise SystemExit("a side of the window failed (its traceback is above)")
    return [o["bytes"] / o["s"] / 1e9 for o in outs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buffer-gib", type=float, default=8.0, help="each side's pinned buffer")
    ap.add_argument("--chunk-mib", type=int, default=64, help="one copy; also one read slice")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=None,
                    help="executor threads (default: the CPUs this process may use, minus 1)")
    ap.add_argument("--bytes-gb", type=float, default=None,
                    help="non-resident expert bytes of a prefill (GB), for the least time")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    for name in ("buffer_gib", "chunk_mib", "seconds"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_concurrency.py needs a CUDA GPU")
    cpus = len(os.sched_getaffinity(0))
    threads = a.threads or max(1, cpus - 1)
    chunk = a.chunk_mib << 20
    n = int(a.buffer_gib * (1 << 30)) // chunk * chunk
    if n == 0:
        ap.error("--buffer-gib must hold at least one --chunk-mib")
    pinned = torch.ones(n, dtype=torch.uint8).pin_memory()
    host = torch.ones(n, dtype=torch.uint8).pin_memory()
    slices = list(host.split(chunk))
    dst = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    tiny = {"w13_weight": torch.zeros(8, 2 * 16, 64, dtype=torch.bfloat16),
            "w2_weight": torch.zeros(8, 64, 16, dtype=torch.bfloat16)}
    with CpuExpertExecutor(tiny, num_threads=threads) as ex:
        h2d = (copies, (pinned, dst, chunk))
        cpu = (reads, (ex, slices))
        window(0.5, [h2d, cpu])  # warm-up: pages, threads, the copy path
        alone_p = window(a.seconds, [h2d])[0]
        alone_h = window(a.seconds, [cpu])[0]
        both_p, both_h = window(a.seconds, [h2d, cpu])
        res = {"buffer_gib": n / (1 << 30), "chunk_mib": a.chunk_mib, "seconds": a.seconds,
               "cpus": cpus, "threads": ex.num_threads, "isa": ex.isa,
               "h2d_alone_gbs": alone_p, "cpu_read_alone_gbs": alone_h,
               "h2d_together_gbs": both_p, "cpu_read_together_gbs": both_h,
               "together_sum_gbs": both_p + both_h}
    print(f"pinned H2D alone {alone_p:.1f} GB/s; CPU read alone {alone_h:.1f} GB/s "
          f"({res['threads']} executor threads of {cpus} CPUs, {res['isa']})")
    print(f"together: H2D {both_p:.1f} + CPU read {both_h:.1f} = {both_p + both_h:.1f} GB/s "
          f"({(both_p + both_h) / max(alone_p, alone_h):.2f}x the faster side alone)")
    if a.bytes_gb:
        res["bytes_gb"] = a.bytes_gb
        res["least_s"] = a.bytes_gb / (both_p + both_h)
        print(f"{a.bytes_gb} GB of non-resident experts: at least {res['least_s']:.3f} s "
              f"(PCIe alone {a.bytes_gb / alone_p:.3f} s, CPU alone {a.bytes_gb / alone_h:.3f} s)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
