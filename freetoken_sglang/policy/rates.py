"""B_P and B_H, measured on the machine that serves (paper §3.2): the pinned host-to-GPU
expert-fill bandwidth and the CPU executor's expert-processing bandwidth, both in GB/s on
the model's real expert shape, each alone and both while the other runs (for
``--freetoken-host-rates beside``), and each branch's fixed cost per layer call (F_P, F_H, in
us, for the lone-miss rule of ``miss.py``), with a JSON cache per (GPU, CPU, threads,
expert shape).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import random
import threading
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
    f_p_us: Optional[float] = None  # us, fixed cost of a layer call's fills (None: unknown)
    f_h_us: Optional[float] = None  # us, fixed cost of a CPU executor call with work
    b_p_beside: Optional[float] = None  # GB/s, fills while the executor runs (None: unknown)
    b_h_beside: Optional[float] = None  # GB/s, the executor while fills run

    def split_rates(self, host_rates: str = "alone") -> Tuple[float, float]:
        """``(B_P, B_H)`` for the q* split (``miss.MissPolicy.bandwidth``). ``alone``:
        each rate measured alone, as the paper's Eq. 3 takes them (the CPU reading the host
        memory a busy link leaves, B_H - B_P). ``beside``: the rates measured while both run,
        ``(B_P', B_P' + B_H')``, so that Eq. 3's ``B_H - B_P`` is the CPU's measured B_H'
        and Eq. 4 balances ``q / (m - q) = B_P' / B_H'``.

        Raises:
            ValueError: ``beside`` without the rates beside each other (a
                ``--freetoken-bandwidth`` of two or four numbers), or an unknown name.
        """
        if host_rates == "alone":
            return (self.b_p, self.b_h)
        if host_rates != "beside":
            raise ValueError(f"host rates must be alone or beside, got {host_rates!r}")
        if self.b_p_beside is None or self.b_h_beside is None:
            raise ValueError("--freetoken-host-rates beside needs B_P and B_H measured beside "
                             "each other: give --freetoken-bandwidth B_P,B_H,F_P,F_H,B_P',B_H' "
                             "(python -m freetoken_sglang.profile measures them) or no "
                             "--freetoken-bandwidth")
        return (self.b_p_beside, self.b_p_beside + self.b_h_beside)

    @property
    def fixed_us(self) -> Optional[Tuple[float, float]]:
        """``(F_P, F_H)`` in microseconds, or None when either is unknown."""
        if self.f_p_us is None or self.f_h_us is None:
            return None
        return (self.f_p_us, self.f_h_us)

    @property
    def ratio(self) -> float:
        return self.b_p / self.b_h


def parse_flag(text: str) -> Tuple[float, ...]:
    """``"B_P,B_H"`` in GB/s, optionally followed by ``",F_P,F_H"`` in microseconds, then
    optionally by ``",B_P',B_H'"``, the two rates in GB/s while both run.

    Raises:
        ValueError: not two positive numbers, optionally followed by two non-negative ones
            and then two positive ones.
    """
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if (len(values) not in (2, 4, 6) or min(values[:2]) <= 0 or min(values) < 0
            or min(values[4:6], default=1) <= 0):
        raise ValueError(
            "expected B_P,B_H as two positive GB/s numbers, optionally followed by F_P,F_H "
            "in microseconds, then by B_P',B_H' (GB/s while both run) (e.g. 50,120, "
            f"50,120,4,20 or 50,120,4,20,45,100), got {text!r}"
        )
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


def machine_key(device: torch.device, threads: int, expert_shape: str, isa: str) -> str:
    """The profile cache's key: the GPU, the CPU model, the executor's threads and kernel
    path (``CpuExpertExecutor.isa``), and the expert shape."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    return f"gpu={gpu}|cpu={cpu_model()}|threads={threads}|isa={isa}|expert={expert_shape}"


def load_cached(path: str, key: str) -> Optional[Dict[str, float]]:
    try:
        with open(path) as f:
            return json.load(f).get(key)
    except (OSError, ValueError):
        return None


def store_cached(path: str, key: str, entry: Dict[str, object]) -> None:
    """Add ``entry`` under ``key`` to the profile cache; a cache that cannot be written is
    logged and skipped (the next start measures again)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
        data[key] = entry
        # a file of this writer's own (process and thread): servers starting together
        # never replace the cache with each other's half-written one
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        logger.warning("FreeToken: the bandwidth profile was not cached in %s (%s)", path, e)


def measure_fill(
    pool_banks: Dict[str, torch.Tensor],
    device_pool_banks: Dict[str, torch.Tensor],
    device: torch.device,
    batch: int = 8,
    seconds: float = 1.0,
    start: Optional[threading.Barrier] = None,
) -> float:
    """B_P in GB/s: batches of ``batch`` random experts copied from the pool into scratch
    slots with the cache's own fill path (UVA reads of the pinned pool on CUDA); with
    ``start``, the timed window opens when every party has reached it (after the warm-up)."""
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
    if start is not None:
        start.wait()
    total, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        p, n = plan()
        filler.run(p)
        total += n * expert_bytes
    sync(device)
    return total / (time.perf_counter() - t0) / 1e9


def measure_executor(executor, hidden: int, dtype: torch.dtype, expert_bytes: int,
                     experts_per_call: int = 4, seconds: float = 1.0,
                     start: Optional[threading.Barrier] = None) -> float:
    """B_H in GB/s: decode-like calls (one token, ``experts_per_call`` random experts) of the
    CPU executor over its banks; bytes of the distinct experts read per second
    (``expert_bytes``: one expert's bytes in the pool, scales included); ``start`` as
    ``measure_fill``'s."""
    rng = random.Random(1)
    n_experts = executor.num_experts
    x = torch.randn(1, hidden).to(dtype)
    out = torch.zeros(1, hidden, dtype=torch.float32)
    k = min(experts_per_call, n_experts)
    rows = torch.zeros(k, dtype=torch.int32)
    weights = torch.full((k,), 1.0 / k, dtype=torch.float32)
    executor.run(x, rows, torch.arange(k, dtype=torch.int32), weights, out)  # warm-up
    if start is not None:
        start.wait()
    total, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ids = torch.tensor(rng.sample(range(n_experts), k), dtype=torch.int32)
        executor.run(x, rows, ids, weights, out)
        total += k * expert_bytes
    return total / (time.perf_counter() - t0) / 1e9


def measure_beside(pool_banks: Dict[str, torch.Tensor],
                   device_pool_banks: Dict[str, torch.Tensor], device: torch.device, executor,
                   hidden: int, dtype: torch.dtype, expert_bytes: int,
                   seconds: float = 1.0) -> Tuple[float, float]:
    """``(B_P', B_H')`` in GB/s: ``measure_fill`` on a side thread (on ``device``) while
    ``measure_executor`` runs, both windows of ``seconds`` opened together after each side's
    warm-up, as a decode layer call's fill and CPU branches share the host's memory (the
    executor's calls release the GIL). Paper §3.2 Eq. 3 assumes ``B_H' = B_H - B_P``; this
    measures it. The side thread's Python loop takes a core from the executor's threads, so
    B_H' errs low (towards the paper's split).

    Raises:
        the exception of the side that failed first.
    """
    got: Dict[str, object] = {}
    start = threading.Barrier(2, timeout=120)
    # a new thread's current CUDA device is 0: the side thread takes the caller's
    index = (device.index if device.index is not None else torch.cuda.current_device()
             ) if device.type == "cuda" else None

    def fills():
        try:
            if index is not None:
                torch.cuda.set_device(index)
            got["b_p"] = measure_fill(pool_banks, device_pool_banks, device, seconds=seconds,
                                      start=start)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            got["error"] = e
            start.abort()

    side = threading.Thread(target=fills, name="freetoken-bandwidth-beside", daemon=True)
    side.start()
    try:
        b_h = measure_executor(executor, hidden, dtype, expert_bytes, seconds=seconds,
                               start=start)
    except BaseException:
        start.abort()  # the other side stops waiting
        side.join()
        fill_error = got.get("error")
        if fill_error is not None and not isinstance(fill_error, threading.BrokenBarrierError):
            raise fill_error  # the fill side failed first
        raise
    side.join()
    if "error" in got:
        raise got["error"]
    return float(got["b_p"]), b_h


def measure_executor_tokens(executor, hidden: int, dtype: torch.dtype,
                            tokens: Optional[Tuple[int, int]] = None, experts_per_call: int = 8,
                            repeats: int = 5) -> float:
    """g in us: the CPU executor's time per (token, expert) item beyond reading the expert,
    the slope of a call's time over the tokens each of its ``experts_per_call`` random
    experts gets (``tokens``: two counts, default (1, 32), or (32, 256) when the executor
    runs such experts on AMX tiles, where the tiles' compute shows; median of ``repeats``),
    for the prefill CPU share's rule (``execute/prefill_cpu.py``)."""
    if tokens is None:
        tokens = (32, 256) if executor.tiled else (1, 32)
    rng = random.Random(4)
    n_experts = executor.num_experts
    k = min(experts_per_call, n_experts)
    times = {}
    for t in tokens:
        x = torch.randn(t, hidden).to(dtype)
        out = torch.zeros(t, hidden, dtype=torch.float32)
        rows = torch.arange(t, dtype=torch.int32).repeat_interleave(k)
        weights = torch.full((t * k,), 1.0 / k, dtype=torch.float32)
        samples = []
        for i in range(repeats + 1):
            ids = torch.tensor(rng.sample(range(n_experts), k), dtype=torch.int32).repeat(t)
            t0 = time.perf_counter()
            executor.run(x, rows, ids, weights, out)
            if i:  # the first call warms up
                samples.append((time.perf_counter() - t0) * 1e6)
        times[t] = _median(samples)
    (t1, s1), (t2, s2) = sorted(times.items())
    return max(0.0, (s2 - s1) / ((t2 - t1) * k))


def resolve_token_cost(pool, executor, device: torch.device, hidden: int,
                       act_dtype: torch.dtype, cache_path: str = DEFAULT_CACHE) -> float:
    """g (us per token-expert item; ``measure_executor_tokens``) from the cached profile of
    this machine, kernel path and expert shape, else measured now (under a second) and stored
    there."""
    key = machine_key(device, executor.num_threads, expert_shape(pool.specs["w13_weight"]),
                      executor.isa)
    cached = load_cached(cache_path, key) or {}
    if "G_H_us" in cached:
        return float(cached["G_H_us"])
    g = measure_executor_tokens(executor, hidden, act_dtype)
    store_cached(cache_path, key, {**cached, "G_H_us": g})
    logger.info("FreeToken: the CPU executor's cost per token-expert item (%s): %.3f us",
                executor.isa, g)
    return g


def intercept(n1: int, t1: float, n2: int, t2: float) -> float:
    """The fixed cost of ``t(n) = F + n * s`` through ``(n1, t1)`` and ``(n2, t2)``, at least
    0 (a line fitted to two measured sizes); 0 when the sizes are equal (nothing to fit)."""
    if n1 == n2:
        return 0.0
    slope = (t2 - t1) / (n2 - n1)
    return max(0.0, t1 - n1 * slope)


def _fit(times: Dict[int, float]) -> float:
    """The intercept of two measured sizes; 0 when the pool is too small for two sizes."""
    if len(times) < 2:
        return 0.0
    (n1, t1), (n2, t2) = sorted(times.items())[:2]
    return intercept(n1, t1, n2, t2)


def _median(values):
    v = sorted(values)
    return v[len(v) // 2]


def measure_fill_fixed(
    pool_banks: Dict[str, torch.Tensor],
    device_pool_banks: Dict[str, torch.Tensor],
    device: torch.device,
    sizes: Tuple[int, int] = (1, 8),
    repeats: int = 30,
) -> float:
    """F_P in us: the intercept of a layer call's fill time over its expert count, fills of
    ``sizes`` random experts through the cache's own fill path (median of ``repeats``; on
    CUDA the fill is captured in a CUDA graph and its replays timed by events, so the host's
    Triton launch latency is left out, as in the serving graphs)."""
    from freetoken_sglang.cache.fills import Filler
    from freetoken_sglang.cache.residency import FillPlan

    rows = next(iter(pool_banks.values())).shape[0]
    batch = max(sizes)
    slots = {
        n: torch.empty((batch, *b.shape[1:]), dtype=b.dtype, device=device)
        for n, b in pool_banks.items()
    }
    filler = Filler(pool_banks, device_pool_banks, slots)
    rng = random.Random(2)
    cuda = device.type == "cuda"
    times = {}
    for n in sizes:
        n = min(n, rows)
        samples = []
        plan = FillPlan(torch.zeros(n, dtype=torch.int32, device=device),
                        torch.arange(n, dtype=torch.int32).to(device),
                        torch.tensor([n], dtype=torch.int32).to(device))
        graph = None
        if cuda:
            plan.src.copy_(torch.tensor(rng.sample(range(rows), n), dtype=torch.int32))
            filler.run(plan)  # compiles
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                filler.run(plan)
        for i in range(repeats + 1):
            plan.src.copy_(torch.tensor(rng.sample(range(rows), n), dtype=torch.int32))
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                dt = start.elapsed_time(end) * 1e3
            else:
                t0 = time.perf_counter()
                filler.run(plan)
                dt = (time.perf_counter() - t0) * 1e6
            if i:  # the first call compiles
                samples.append(dt)
        times[n] = _median(samples)
    return _fit(times)


def measure_executor_fixed(executor, hidden: int, dtype: torch.dtype,
                           sizes: Tuple[int, int] = (1, 4), repeats: int = 30) -> float:
    """F_H in us: the intercept of a one-token CPU executor call's time over its expert
    count (``sizes`` random experts, median of ``repeats``): the workers' start and join.
    The CPU branch's own hand-off is not in it (the doorbell's round trip is not measured;
    the host-node mechanism runs on every layer call, with work or without)."""
    rng = random.Random(3)
    n_experts = executor.num_experts
    x = torch.randn(1, hidden).to(dtype)
    out = torch.zeros(1, hidden, dtype=torch.float32)
    times = {}
    for k in sizes:
        k = min(k, n_experts)
        rows = torch.zeros(k, dtype=torch.int32)
        weights = torch.full((k,), 1.0 / k, dtype=torch.float32)
        samples = []
        for i in range(repeats + 1):
            ids = torch.tensor(rng.sample(range(n_experts), k), dtype=torch.int32)
            t0 = time.perf_counter()
            executor.run(x, rows, ids, weights, out)
            if i:
                samples.append((time.perf_counter() - t0) * 1e6)
        times[k] = _median(samples)
    return _fit(times)


def resolve(
    flag: Optional[Tuple[float, ...]],
    pool,
    executor,
    device: torch.device,
    hidden: int,
    act_dtype: torch.dtype,
    cache_path: str = DEFAULT_CACHE,
    beside: bool = False,
) -> Bandwidth:
    """The bandwidths (and fixed costs) to serve with: the flag, else the cached profile of
    this machine and expert shape, else a measurement now (a few seconds; stored in
    ``cache_path``). With ``beside`` (``--freetoken-host-rates beside``) the profile also
    holds B_P' and B_H' (``measure_beside``, about a second more; a cached profile without
    them gets them now); without, they are given where cached, else left unknown. A flag
    without fixed costs leaves them unknown (no lone-miss rule), one without the rates beside
    each other leaves those unknown (``Bandwidth.split_rates`` names the fix)."""
    if flag is not None:
        fixed = tuple(flag[2:4]) if len(flag) >= 4 else (None, None)
        rates = tuple(flag[4:6]) if len(flag) == 6 else (None, None)
        return Bandwidth(flag[0], flag[1], "flag --freetoken-bandwidth", *fixed, *rates)
    key = machine_key(device, executor.num_threads, expert_shape(pool.specs["w13_weight"]),
                      executor.isa)
    cached = load_cached(cache_path, key)

    def measured_beside() -> Dict[str, object]:
        b_pb, b_hb = measure_beside(pool.banks, pool.device_banks, device, executor, hidden,
                                    act_dtype, pool.expert_bytes)
        return {"B_P_beside": b_pb, "B_H_beside": b_hb,
                "beside_measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}

    if cached and "F_P_us" in cached and "F_H_us" in cached:
        if beside and ("B_P_beside" not in cached or "B_H_beside" not in cached):
            cached = {**cached, **measured_beside()}
            store_cached(cache_path, key, cached)
        return Bandwidth(cached["B_P"], cached["B_H"], f"cache {cache_path}",
                         cached["F_P_us"], cached["F_H_us"], cached.get("B_P_beside"),
                         cached.get("B_H_beside"))
    logger.info(
        "FreeToken: measuring B_P (pinned fills), B_H (CPU executor, %d threads)%s and their "
        "fixed costs on this machine; this runs once per machine and expert shape (a few "
        "seconds) ...", executor.num_threads, ", both beside each other," if beside else "",
    )
    t0 = time.perf_counter()
    b_p = measure_fill(pool.banks, pool.device_banks, device)
    b_h = measure_executor(executor, hidden, act_dtype, pool.expert_bytes)
    rates = measured_beside() if beside else {}
    f_p = measure_fill_fixed(pool.banks, pool.device_banks, device)
    f_h = measure_executor_fixed(executor, hidden, act_dtype)
    entry = {
        "B_P": b_p,
        "B_H": b_h,
        **rates,
        "F_P_us": f_p,
        "F_H_us": f_h,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": time.perf_counter() - t0,
    }
    store_cached(cache_path, key, {**(cached or {}), **entry})
    return Bandwidth(b_p, b_h, "measured", f_p, f_h, rates.get("B_P_beside"),
                     rates.get("B_H_beside"))
