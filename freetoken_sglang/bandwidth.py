"""B_P and B_H, measured on the machine that serves (paper §3.2): the pinned host-to-GPU
expert-fill bandwidth and the CPU executor's expert-processing bandwidth, both in GB/s on
the model's real expert shape, with a JSON cache per (GPU, CPU, threads, expert shape).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import random
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "freetoken", "bandwidth.json")


@dataclass(frozen=True)
class Bandwidth:
    b_p: float  # GB/s, host pool -> GPU slots, as fills are issued
    b_h: float  # GB/s, CPU executor on the expert shape, data not in cache
    source: str  # "flag", "cache <path>" or "measured"

    @property
    def ratio(self) -> float:
        return self.b_p / self.b_h


def parse_flag(text: str) -> Tuple[float, float]:
    """``"B_P,B_H"`` in GB/s.

    Raises:
        ValueError: not two positive numbers.
    """
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or min(values) <= 0:
        raise ValueError(f"expected B_P,B_H as two positive GB/s numbers, got {text!r}")
    return values


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def expert_shape(spec) -> str:
    """The profile's expert-shape key of a pool's ``w13_weight`` BankSpec, e.g.
    ``1536x2048:bfloat16``."""
    return "x".join(str(d) for d in spec.shape) + ":" + str(spec.dtype).replace("torch.", "")


def machine_key(device: torch.device, threads: int, expert_shape: str) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    return f"gpu={gpu}|cpu={cpu_model()}|threads={threads}|expert={expert_shape}"


def load_cached(path: str, key: str) -> Optional[Dict[str, float]]:
    try:
        with open(path) as f:
            return json.load(f).get(key)
    except (OSError, ValueError):
        return None


def store_cached(path: str, key: str, entry: Dict[str, object]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data[key] = entry
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def measure_fill(
    pool_banks: Dict[str, torch.Tensor],
    device_pool_banks: Dict[str, torch.Tensor],
    device: torch.device,
    batch: int = 8,
    seconds: float = 1.0,
) -> float:
    """B_P in GB/s: batches of ``batch`` random experts copied from the pool into scratch
    slots with the cache's own fill path (UVA reads of the pinned pool on CUDA)."""
    from freetoken_sglang.cache.fills import Filler
    from freetoken_sglang.cache.residency import FillPlan

    rows = next(iter(pool_banks.values())).shape[0]
    slots = {
        n: torch.empty((batch, *b.shape[1:]), dtype=b.dtype, device=device)
        for n, b in pool_banks.items()
    }
    filler = Filler(pool_banks, device_pool_banks, slots)
    expert_bytes = sum(b[0].numel() * b.element_size() for b in pool_banks.values())
    rng = random.Random(0)

    def plan():
        src = torch.tensor(rng.sample(range(rows), min(batch, rows)), dtype=torch.int32)
        n = src.numel()
        return FillPlan(
            src.to(device),
            torch.arange(n, dtype=torch.int32).to(device),
            torch.tensor([n], dtype=torch.int32).to(device),
        ), n

    p, n = plan()
    filler.run(p)  # warm-up (kernel compile)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    total, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        p, n = plan()
        filler.run(p)
        total += n * expert_bytes
    sync(device)
    return total / (time.perf_counter() - t0) / 1e9


def measure_executor(executor, hidden: int, dtype: torch.dtype, expert_bytes: int,
                     experts_per_call: int = 4, seconds: float = 1.0) -> float:
    """B_H in GB/s: decode-like calls (one token, ``experts_per_call`` random experts) of the
    CPU executor over its banks; bytes of the distinct experts read per second
    (``expert_bytes``: one expert's bytes in the pool, scales included)."""
    rng = random.Random(1)
    n_experts = executor.num_experts
    x = torch.randn(1, hidden).to(dtype)
    out = torch.zeros(1, hidden, dtype=torch.float32)
    k = min(experts_per_call, n_experts)
    rows = torch.zeros(k, dtype=torch.int32)
    weights = torch.full((k,), 1.0 / k, dtype=torch.float32)
    executor.run(x, rows, torch.arange(k, dtype=torch.int32), weights, out)  # warm-up
    total, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ids = torch.tensor(rng.sample(range(n_experts), k), dtype=torch.int32)
        executor.run(x, rows, ids, weights, out)
        total += k * expert_bytes
    return total / (time.perf_counter() - t0) / 1e9


def resolve(
    flag: Optional[Tuple[float, float]],
    pool,
    executor,
    device: torch.device,
    hidden: int,
    act_dtype: torch.dtype,
    cache_path: str = DEFAULT_CACHE,
) -> Bandwidth:
    """The bandwidths to serve with: the flag, else the cached profile of this machine and
    expert shape, else a measurement now (a few seconds; stored in ``cache_path``)."""
    if flag is not None:
        return Bandwidth(flag[0], flag[1], "flag --freetoken-bandwidth")
    key = machine_key(device, executor.num_threads, expert_shape(pool.specs["w13_weight"]))
    cached = load_cached(cache_path, key)
    if cached:
        return Bandwidth(cached["B_P"], cached["B_H"], f"cache {cache_path}")
    logger.info(
        "FreeToken: measuring B_P (pinned fills) and B_H (CPU executor, %d threads) on this "
        "machine; this runs once per machine and expert shape (a few seconds) ...",
        executor.num_threads,
    )
    t0 = time.perf_counter()
    b_p = measure_fill(pool.banks, pool.device_banks, device)
    b_h = measure_executor(executor, hidden, act_dtype, pool.expert_bytes)
    entry = {
        "B_P": b_p,
        "B_H": b_h,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": time.perf_counter() - t0,
    }
    store_cached(cache_path, key, entry)
    return Bandwidth(b_p, b_h, "measured")
