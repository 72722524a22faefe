"""The least TTFT any split of a prefill between PCIe fills and the CPU can reach on a machine,
per turn of recorded agent sessions, against stock SGLang's measured TTFTs (issue 12's target).

A turn that prefills ``n`` new tokens (its true suffix, the least any cache re-prefills) reads,
in each of ``L`` MoE layers, the non-resident experts it routes to: ``m = E - slots / L`` of
them, each hit with probability ``1 - (1 - k/E)^n`` (uniform routing, as dummy weights route).
An expert of ``S`` bytes takes ``p = S / B_P`` over PCIe or ``h = max(S / B_H, c(t))`` on the
CPU, ``B_P`` and ``B_H`` the rates measured *together* (``bench_host_concurrency.py``) and
``c(t)`` the executor's time for one expert at ``t = n k / E`` tokens (``bench_cpu_tiles.py``,
interpolated in ``t`` and scaled to the shape's ``hidden x inter``). The best split runs both
sides at once: ``L m_hit / (1/p + 1/h)``. Everything else a turn does (attention, the resident
experts, the recurrent layers, HTTP) is left out, so this is a lower bound.

    python benchmarks/ttft_bound.py --shape qwen3.6-35b-a3b --cache-ratio 0.25 \\
        --host results/h100-2026-12-05-s25/call3/host_concurrency.json \\
        --cpu results/h100-2026-12-05-s24/call1/tiles.json --isa amx \\
        --stock results/h200-2026-12-02-s9/anchors-call1-runs.json \\
        [--ft results/h200-2026-12-02-s12/anchors/runs.json]

Per session: stock's worst TTFT, the least FreeToken's worst turn can take, and the cache ratio
from which that bound fits the target (at most ``--target`` x stock's worst).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import servers  # noqa: E402


@dataclass(frozen=True)
class Machine:
    """Measured rates: ``b_p``, ``b_h`` (GB/s, PCIe and CPU read at once) and the executor's
    us per expert by tokens per expert, ``cpu_us`` ``[(tokens, us)]`` ascending, for experts of
    ``hidden x inter``; or, with ``tflops``, a CPU computing at that rate instead (what a
    faster executor would reach; its reads still at ``b_h``)."""

    b_p: float
    b_h: float
    cpu_us: Tuple[Tuple[float, float], ...]
    hidden: int
    inter: int
    tflops: Optional[float] = None


@dataclass(frozen=True)
class Shape:
    layers: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    dtype_bytes: int = 2

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.inter * self.dtype_bytes


def cpu_time_us(m: Machine, shape: Shape, tokens: float) -> float:
    """The executor's us for one expert at ``tokens`` tokens: linear between the measured
    counts, proportional beyond the last, the first count's time below it; scaled by the
    shape's ``hidden x inter`` over the measured one."""
    if m.tflops:
        return 2 * 3 * shape.hidden * shape.inter * tokens / (m.tflops * 1e6)
    pts = m.cpu_us
    scale = shape.hidden * shape.inter / (m.hidden * m.inter)
    if tokens <= pts[0][0]:
        return pts[0][1] * scale
    for (a, ua), (b, ub) in zip(pts, pts[1:]):
        if tokens <= b:
            return (ua + (ub - ua) * (tokens - a) / (b - a)) * scale
    a, ua = pts[-1]
    return ua * tokens / a * scale


def turn_bound_s(m: Machine, shape: Shape, cache_ratio: float, n: int) -> float:
    """The least seconds a prefill of ``n`` new tokens spends reading non-resident experts."""
    if n <= 0:
        return 0.0
    slots = int(shape.layers * shape.experts * cache_ratio)
    missing = shape.experts - slots / shape.layers
    hit = 1.0 - (1.0 - shape.top_k / shape.experts) ** n
    s = shape.expert_bytes
    p = s / (m.b_p * 1e3)
    h = max(s / (m.b_h * 1e3), cpu_time_us(m, shape, n * shape.top_k / shape.experts))
    return shape.layers * missing * hit / (1.0 / p + 1.0 / h) / 1e6


def ratio_for(m: Machine, shape: Shape, cache_ratio: float, n: int, target_s: float) -> float:
    """The least cache ratio (within 1e-12, bisected) at which ``turn_bound_s`` of ``n``
    tokens is at most ``target_s`` (the bound falls with the non-resident experts, in steps
    of whole slots); 1.0 if none less."""
    lo, hi = cache_ratio, 1.0
    if turn_bound_s(m, shape, lo, n) <= target_s:
        return lo
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if turn_bound_s(m, shape, mid, n) <= target_s else (mid, hi)
    return hi


def load_machine(host_json: str, cpu_json: str, isa: str) -> Machine:
    with open(host_json) as f:
        host = json.load(f)
    with open(cpu_json) as f:
        tiles = json.load(f)
    rows = [r for r in tiles["rows"] if isa in r]
    if not rows:
        first = tiles["rows"][0]
        paths = sorted(k for k, v in first.items() if isinstance(v, dict))
        raise SystemExit(f"{cpu_json} has no '{isa}' rows; choose --isa from {paths}")
    return Machine(host["h2d_together_gbs"], host["cpu_read_together_gbs"],
                   tuple((r["tokens"], r[isa]["us_per_expert"]) for r in rows),
                   tiles["hidden"], tiles["inter"])


def load_shape(name: str) -> Shape:
    cfg = servers.shape_config(name)
    if "quantization_config" in cfg:
        raise SystemExit(f"ttft_bound.py counts BF16 experts; {name} is quantized: choose a "
                         "BF16 shape")
    t = cfg.get("text_config", cfg)
    return Shape(t["num_hidden_layers"], t.get("num_experts") or t["num_local_experts"],
                 t["num_experts_per_tok"], t["hidden_size"],
                 t.get("moe_intermediate_size") or t["intermediate_size"])


def sessions_of(runs_json: str) -> Dict[str, List[dict]]:
    """``{session: requests}`` of the first run of an ``anchor_bench.py`` runs file."""
    with open(runs_json) as f:
        run = json.load(f)["runs"][0]
    return {name: s["requests"] for name, s in run["sessions"].items()}


def report(m: Machine, shape: Shape, cache_ratio: float, stock: Dict[str, List[dict]],
           ft: Dict[str, List[dict]], target: float) -> List[str]:
    lines = ["| session | stock worst TTFT (s) | target (s) | least FreeToken worst turn (s), "
             "its new tokens | FreeToken measured worst (s) | cache ratio where the bound "
             "fits |", "|---|---:|---:|---|---:|---:|"]
    for name, reqs in stock.items():
        worst = max(r["ttft_s"] for r in reqs)
        goal = target * worst
        bounds = [(turn_bound_s(m, shape, cache_ratio, r["suffix"]), r["suffix"]) for r in reqs]
        b, n = max(bounds)
        need = max(ratio_for(m, shape, cache_ratio, r["suffix"], goal) for r in reqs)
        mine = ft.get(name)
        measured = f"{max(r['ttft_s'] for r in mine):.2f}" if mine else "-"
        lines.append(f"| {name} | {worst:.2f} | {goal:.2f} | {b:.2f} ({n}) | {measured} | "
                     f"{need:.2f} |")
    return lines


def main(argv: Sequence[str] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.6-35b-a3b", help="a shape of servers.py")
    ap.add_argument("--cache-ratio", type=float, default=0.25)
    ap.add_argument("--host", required=True, help="bench_host_concurrency.py --json output")
    ap.add_argument("--cpu", required=True, help="bench_cpu_tiles.py --json output")
    ap.add_argument("--isa", default="amx", help="the executor path of --cpu to use")
    ap.add_argument("--stock", required=True, help="anchor_bench.py runs.json of stock")
    ap.add_argument("--ft", default=None, help="anchor_bench.py runs.json of FreeToken")
    ap.add_argument("--target", type=float, default=2.0, help="x stock's worst TTFT")
    ap.add_argument("--cpu-tflops", type=float, default=None,
                    help="a CPU computing at this rate instead of --cpu's measured one "
                    "(inf: bandwidth only)")
    a = ap.parse_args(argv)
    m = load_machine(a.host, a.cpu, a.isa)
    if a.cpu_tflops:
        m = dataclasses.replace(m, tflops=a.cpu_tflops)
    shape = load_shape(a.shape)
    print(f"{a.shape}: {shape.layers} MoE layers x {shape.experts} experts, top-{shape.top_k}, "
          f"{shape.expert_bytes / 2**20:.2f} MiB per expert, cache {a.cache_ratio:g}; PCIe "
          f"{m.b_p:.1f} and CPU read {m.b_h:.1f} GB/s at once; CPU "
          + (f"at {m.tflops:g} TFLOPS" if m.tflops else f"path {a.isa}, measured"))
    print("\n".join(report(m, shape, a.cache_ratio, sessions_of(a.stock),
                           sessions_of(a.ft) if a.ft else {}, a.target)))


if __name__ == "__main__":
    main()
