"""A cost model of the decode miss policies over a routing trace: modelled tok/s, not a measurement.

    python benchmarks/policy_model.py TRACE.npz [--ratios 0.5,0.25,0.1] [--bs 1,4]

Replays a trace's decode rows (``observe/routing_trace.py``; trace layers spread over the
shape's MoE layers as ``--freetoken-replay-routing`` does; by default in the order
``bench_decode.py`` consumes them, ``run_bench_cell``, else ``bs`` consecutive rows per step,
cycling) through the server's own decision (``cache.residency.decide_reference``, the kernel's
tested reference) for each miss policy (``policy.miss.MissPolicy``). As ``bench_decode.py
--cache-ratios`` runs a server, the cache starts all resident and is shrunk to each ratio in
turn (``cache/resize.py``), bs 1 then bs 4 at each, ``--warm-steps`` unmeasured steps first.
Each layer call then costs, in microseconds,

    all-hit layer time (stock's step time at ``--stock-tok-s``, over L)
    + max(fill branch, CPU branch),
    fill branch = F_P + q S / B_P                                   (q fills; 0 if none)
    CPU branch  = F_H + the c CPU experts' S bytes read at B_H - B_P while the fills run
                  and at B_H after them                              (0 if c = 0)

or, where ``--bandwidth`` or ``--timing`` gives the rates beside each other too (six numbers,
``policy.rates.measure_beside``), the fills at B_P' throughout a call with CPU work (B_P without)
and the CPU at B_H' while the fills run, B_H after. A policy
label ending in ``+beside`` decides with those rates (``--freetoken-host-rates beside``).

with the paper's Eq. 1-3 and the constants measured on the H200 (``--bandwidth``; defaults:
Session 17's B_P 43.8, B_H 108.9 GB/s, F_P 9.9, F_H 19.9 us; stock's 252.33 / 449.50 tok/s
at bs 1 / 4). It ignores launch gaps, the GPU's MoE time over more experts, and the CPU
partial's merge. Use it to choose what to measure on the GPU, never as a result: check it
against a measured matrix first (``benchmarks/RESULTS.md``, Session 23).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from freetoken_sglang.cache.residency import ResidencyState, decide_reference  # noqa: E402
from freetoken_sglang.cache.resize import install, kept_experts, kept_fill_clocks  # noqa: E402
from freetoken_sglang.policy.miss import MissPolicy  # noqa: E402
from freetoken_sglang.observe.routing_replay import layer_map, ranked  # noqa: E402
from freetoken_sglang.observe.routing_trace import RoutingTrace  # noqa: E402
from servers import shape_config  # noqa: E402

# label: (policy, admission, fill_reused, return_rule, admission's useful form[, the re-miss
# rule's valued form])
POLICIES = {
    "fill": ("fill", False, False, False, False),
    "cpu": ("cpu", False, False, False, False),
    "qstar": ("qstar", False, False, False, False),
    "qstar-admit": ("qstar", True, False, False, False),
    "qstar-remiss": ("qstar", False, True, False, False),
    "qstar-return": ("qstar", False, False, True, False),
    "qstar-both": ("qstar", True, True, False, False),  # admission + re-miss: reused filled
    "qstar-useful": ("qstar", True, False, False, True),
    "qstar-useful-remiss": ("qstar", True, True, False, True),  # reused filled while calm
    # ... and only where expected back at least B_H/B_P - 1 times before eviction
    "qstar-useful-valued": ("qstar", True, True, False, True, True),
}


def expert_bytes(cfg: dict) -> int:
    """S: one BF16 gated expert's bytes (w13 and w2)."""
    return 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2


def layer_us(q: int, c: int, allhit_us: float, s_bytes: int, bw) -> float:
    """One layer call's modelled time (the module docstring's formula)."""
    b_p, b_h, f_p, f_h = bw[:4]
    # the rates while both branches run: measured (six numbers) or Eq. 3's
    b_pb, b_hb = bw[4:6] if len(bw) == 6 else (b_p, b_h - b_p)
    fill = f_p + q * s_bytes / ((b_pb if c else b_p) * 1e3) if q else 0.0
    cpu = 0.0
    if c:
        need = c * s_bytes / 1e3  # bytes / 1e3 = GB/s * us
        beside = fill * max(b_hb, 0.0) if q else 0.0  # readable while the fills run
        cpu = f_h + (need / b_hb if need <= beside else fill + (need - beside) / b_h)
    return allhit_us + max(fill, cpu)


def shrink(state: ResidencyState, slots: int, E: int) -> ResidencyState:
    """The cache after a resize to ``slots`` (``cache/resize.py``: the most recently used
    experts stay; from the all-resident cache, the same share of every layer)."""
    new = ResidencyState(state.num_rows, slots, "cpu")
    kept = kept_experts(state, slots, E)
    install(new, None, kept, int(state.clock), kept_fill_clocks(state, kept))
    return new


def forward(state: ResidencyState, ids: np.ndarray, first: int, rows: int, lmap, E: int,
            split, allhit_us: float, s_bytes: int, bw) -> list:
    """One forward of ``rows`` trace rows from row ``first`` (cyclic) through every MoE
    layer's decision: ``[us, reads, hits, fills, cpu]`` summed over its layer calls."""
    block = torch.from_numpy(
        ids[[(first + i) % ids.shape[0] for i in range(rows)]].astype(np.int32))
    w, nv = torch.ones(rows, ids.shape[2]), torch.tensor([rows], dtype=torch.int32)
    counters = torch.zeros(5, len(lmap), dtype=torch.int64)
    us = 0.0
    for layer in range(len(lmap)):
        decide_reference(state, counters, layer, E, block[:, lmap[layer]].contiguous(), w, nv,
                         split)
        us += layer_us(int(counters[2, layer]), int(counters[4, layer]), allhit_us, s_bytes, bw)
    reads, hits, fills, _, cpu = counters.sum(1).tolist()
    return [us, reads, hits, fills, cpu]


def run_cell(ids: np.ndarray, lmap, E: int, state: ResidencyState, bs: int, policy: MissPolicy,
             allhit_us: float, s_bytes: int, bw, warm: int, steps: int) -> dict:
    """Modelled tok/s and counts of one policy at one batch size, from ``state`` (updated):
    ``warm`` then ``steps`` steps of ``bs`` consecutive rows, cycling."""
    total = [0.0, 0, 0, 0, 0]  # us, reads, hits, fills, cpu
    for step in range(warm + steps):
        got = forward(state, ids, step * bs, bs, lmap, E, policy.decode_split, allhit_us,
                      s_bytes, bw)
        if step >= warm:
            total = [a + b for a, b in zip(total, got)]
    us, reads, hits, fills, cpu = total
    return {"tok_s": bs * steps / (us * 1e-6), "hit_rate": hits / reads,
            "fills_per_step": fills / steps, "cpu_per_step": cpu / steps}


def run_bench_cell(ids: np.ndarray, lmap, E: int, state: ResidencyState, policy: MissPolicy,
                   stock: dict, s_bytes: int, bw, new_tokens: int = 64) -> list:
    """One cache size as ``bench_decode.py``'s ``measure_decode`` runs it after a resize or a
    policy change (the replay rewound to row 0), both batch sizes: a warm-up request of 16
    tokens and a warm-up batch of 4, then 2 requests at batch 1 and 4 concurrent ones of
    ``new_tokens``, their decode counters and modelled tok/s measured as the benchmark's
    windows. Its prompts repeat from cell to cell (a fixed seed), so SGLang's radix cache
    leaves each request a one-row prefill (a batch of 4: one row, then three), each a
    layer call through the LRU like a decode step; a request of n tokens runs n + 1
    one-row forwards, as the server's counters show. Returns the bs 1 and bs 4 results."""
    L = len(lmap)
    cursor = 0
    totals = {1: [0.0, 0, 0, 0, 0], 4: [0.0, 0, 0, 0, 0]}  # us, reads, hits, fills, cpu

    def run(rows: int, window=None) -> None:
        nonlocal cursor
        got = forward(state, ids, cursor, rows, lmap, E, policy.decode_split,
                      1e6 * rows / stock[4 if rows > 1 else 1] / L, s_bytes, bw)
        cursor += rows
        if window is not None:
            totals[window] = [a + b for a, b in zip(totals[window], got)]

    for _ in range(17):  # the warm-up request: its prefill row and 16 more
        run(1)
    run(1)  # the warm-up batch: its prefills (one row, then three), then 16 steps of 4
    run(3)
    for _ in range(16):
        run(4)
    for _ in range(2 * (new_tokens + 1)):  # batch 1: two requests
        run(1, 1)
    run(1, 4)  # batch 4
    run(3, 4)
    for _ in range(new_tokens):
        run(4, 4)
    out = []
    for bs, (us, reads, hits, fills, cpu) in totals.items():
        steps = 2 * (new_tokens + 1) if bs == 1 else new_tokens + 1
        out.append({"tok_s": bs * steps / (us * 1e-6),
                    "hit_rate": hits / reads, "reads": reads, "hits": hits, "fills": fills,
                    "cpu": cpu, "fills_per_step": fills / steps, "cpu_per_step": cpu / steps,
                    "bs": bs})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--ratios", default="0.5,0.25,0.1")
    ap.add_argument("--bs", default="1,4")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--bandwidth", default="43.8,108.9,9.9,19.9",
                    help="B_P,B_H,F_P,F_H[,B_P',B_H']: the server's measured profile, which "
                    "its q* split reads (the decisions), and the modelled times unless --timing")
    ap.add_argument("--timing", default=None,
                    help="B_P,B_H,F_P,F_H[,B_P',B_H'] for the modelled times only (e.g. "
                    "constants fitted to a measured matrix)")
    ap.add_argument("--sequence", choices=("bench", "cycle"), default="bench",
                    help="bench: bench_decode.py's requests per cell (run_bench_cell; both "
                    "batch sizes, --bs and the step counts ignored); cycle: --warm-steps then "
                    "--steps steps of --bs consecutive rows (Session 36's model)")
    ap.add_argument("--stock-tok-s", default="252.33,449.50",
                    help="stock's bs1,bs4 tok/s: the all-hit step time")
    ap.add_argument("--warm-steps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--expert-bytes", type=int, default=None,
                    help="S in bytes (a quantized format's, e.g. /freetoken/stats expert_bytes); "
                    "default: a BF16 gated expert of the shape")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = shape_config(a.shape, None)
    L, E = cfg["num_hidden_layers"], cfg.get("num_experts", cfg.get("num_local_experts"))
    k = cfg["num_experts_per_tok"]
    trace = RoutingTrace.load(a.trace)
    # as the server's replay: a larger top-k in rank order replays each token's first k ids
    if trace.num_experts != E or trace.top_k < k or (trace.top_k > k and not ranked(trace.meta)):
        raise SystemExit(f"{a.trace}: top-{trace.top_k} of {trace.num_experts} experts; the "
                         f"shape routes top-{k} of {E}")
    ids = trace.ids[np.repeat(trace.phase == 1, trace.num_tokens)][..., :k]
    lmap = layer_map(trace.num_layers, L)
    bw = tuple(float(x) for x in a.bandwidth.split(","))
    timing = tuple(float(x) for x in a.timing.split(",")) if a.timing else bw
    for name, vals in (("--bandwidth", bw), ("--timing", timing)):
        if len(vals) not in (4, 6):
            ap.error(f"{name}: give B_P,B_H,F_P,F_H or B_P,B_H,F_P,F_H,B_P',B_H'")
    stock = dict(zip((1, 4), (float(x) for x in a.stock_tok_s.split(","))))
    s_bytes = a.expert_bytes or expert_bytes(cfg)
    print(f"MODEL, not a measurement: {a.trace} ({ids.shape[0]} decode rows), shape {a.shape}, "
          f"S {s_bytes / 2**20:.2f} MiB, B_P,B_H,F_P,F_H {bw} (times: {timing}), "
          f"sequence {a.sequence}", flush=True)
    out = []
    # As bench_decode.py --cache-ratios runs a server: all resident, then shrunk to each ratio
    # in turn (decreasing), bs 1 then bs 4 at each, the cache carried over.
    for label in a.policies.split(","):
        rates = "beside" if label.endswith("+beside") else "alone"
        name, admit, remiss, ret, useful, *valued = POLICIES[label.removesuffix("+beside")]
        if rates == "beside" and (len(bw) != 6 or name != "qstar"):
            ap.error(f"{label}: +beside needs a qstar policy and --bandwidth "
                     "B_P,B_H,F_P,F_H,B_P',B_H'")
        split_bw = (bw[4], bw[4] + bw[5]) if rates == "beside" else bw[:2]
        pol = MissPolicy(name, split_bw, bw[2:4], s_bytes, admit, remiss, ret,
                         admit_useful=useful, fill_reused_valued=bool(valued and valued[0]),
                         host_rates=rates) if name == "qstar" else MissPolicy(name)
        state = ResidencyState(L * E, L * E, "cpu")
        state.make_all_resident()
        for ratio in (float(r) for r in a.ratios.split(",")):
            state = shrink(state, int(round(ratio * L * E)), E)
            t0 = time.perf_counter()
            if a.sequence == "bench":
                cells = run_bench_cell(ids, lmap, E, state, pol, stock, s_bytes, timing)
            else:
                cells = [dict(run_cell(ids, lmap, E, state, bs, pol, 1e6 * bs / stock[bs] / L,
                                       s_bytes, timing, a.warm_steps, a.steps), bs=bs)
                         for bs in (int(b) for b in a.bs.split(","))]
            for r in cells:
                r.update(ratio=ratio, policy=label, sim_s=time.perf_counter() - t0)
                out.append(r)
                print(json.dumps(r), flush=True)
    print("\nMODEL: tok/s (hit rate) per policy")
    labels = a.policies.split(",")
    print("| ratio | bs | " + " | ".join(labels) + " |")
    for ratio in sorted({r["ratio"] for r in out}, reverse=True):
        for bs in sorted({r["bs"] for r in out}):
            cell = {r["policy"]: r for r in out if r["ratio"] == ratio and r["bs"] == bs}
            print(f"| {ratio} | {bs} | " + " | ".join(
                f"{cell[p]['tok_s']:.1f} ({cell[p]['hit_rate']:.2f})" for p in labels) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "shape": a.shape, "bandwidth": bw, "model": True,
                       "cells": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
