"""Serve one model with each system in turn under the same GPU memory budget, drive each with
the same agent workloads, and write one combined table, plots, a roofline and replay plots
of the recorded routing (paper §5).

Systems (``--systems``, comma-separated):

- ``stock-gpu``: stock SGLang, every expert on the GPU (the upper bound, where it fits);
- ``stock-offload``: stock SGLang with ``--cpu-offload-gb`` set to the expert pool minus
  FreeToken's cache, to the nearest whole GiB (SGLang takes an int; Python's ``round``,
  halves to even), so that its GPU weight memory matches FreeToken's budget to within
  0.5 GiB;
- ``ft-qstar``, ``ft-fill``, ``ft-cpu``: FreeToken with each miss policy, the cache at
  ``--cache-ratio`` of the pool, recording routing traces;
- ``ft-allhit``: FreeToken with every expert resident, for the roofline's all-hit step time
  (stock SGLang's MoE over the slots since session 16's resident executor);
- ``ft-fill-lru``: ``ft-fill`` with prefill through the decode LRU (``--freetoken-prefill
  lru``), the prefill path before streaming;
- ``ft-fill-reserved``: ``ft-fill`` with the prefill buffers reserved outside the LRU
  (``--freetoken-prefill-buffers reserved``) instead of borrowed from it.

    python benchmarks/run_all.py --shape qwen3-30b-a3b --cache-ratio 0.25 --scale 0.05 \\
        --systems stock-gpu,stock-offload,ft-qstar,ft-fill,ft-cpu --out-dir results/
    python benchmarks/run_all.py --model-path TINY --cpu --scale 0.01 --decode-cap 4 \\
        --systems stock-gpu,ft-qstar --out-dir /tmp/smoke        # CPU smoke run
    python benchmarks/run_all.py --shape qwen3-30b-a3b --systems ft-cpu,stock-offload \\
        --append results/runs.json --out-dir results2/    # adds systems to an earlier run
    python benchmarks/run_all.py --shape qwen3-30b-a3b --systems "" \\
        --append results2/runs.json --out-dir report/ --no-replay   # report only, no server

Per system: a server start, optionally a decode benchmark (``--decode-bench N``: random
128-token prompts, N tokens at batch 1 and 4, ``bench_decode.measure_decode``), then the
workloads (``serve_bench.run_system``), cut at ``--budget-s`` seconds (the table shows
``run/planned (budget)``). ``runs.json`` (``{"runs": [...], "errors": [...]}``) and the
report are rewritten after every system, so a run stopped part-way keeps the finished
systems; a system that fails (its server does not start, ...) is listed with its error.
``--append`` puts the runs of earlier ``runs.json`` files first.

Ratios: each system's decode tok/s and mean / worst TTFT per workload (and decode-bench
tok/s) over the best baseline's in the report; baselines are the systems whose label does
not start with ``ft-`` (``stock-gpu``, ``stock-offload``). A workload ratio covers the
requests that both runs finished (``ratios``), so a budget-cut run is compared with the same
requests of the baseline; the best baseline is the one the system compares worst against.

Roofline (per FreeToken run and workload): the decode misses each token took (fills + CPU
misses of decode-sized layer calls, from ``/freetoken/stats``), served at the better of PCIe
fill and CPU execution balanced by q* (``S / max(B_P, B_H)`` per missed expert of S bytes:
fills and the CPU read the same host memory, so under paper §3.2 Eq. 2-4 the CPU gets only
the residual ``B_H - B_P`` while fills run, and the q*-balanced layer takes ``m S / B_H``),
plus the TPOT of an all-hit step (``ft-allhit``'s, else ``stock-gpu``'s, over the requests the
run finished); reported as achieved decode tok/s / the bound's tok/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_decode  # noqa: E402
import serve_bench  # noqa: E402
from servers import GpuMemorySampler, Server, stop_servers_on_sigterm, write_shape  # noqa: E402

FT = ["--enable-freetoken"]


def expert_pool_gib(model_path: str) -> float:
    """The routed-expert pool size (GiB) of a model, from its config."""
    from transformers import AutoConfig

    from freetoken_sglang import families
    from freetoken_sglang.experts.pool import GIB, bank_specs_for_layer

    import torch

    cfg = AutoConfig.from_pretrained(model_path)
    dtype = getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None) or "bfloat16"
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    hidden, inter = families.text_config(cfg).hidden_size, families.expert_intermediate_size(cfg)
    specs = bank_specs_for_layer(hidden, inter, dtype)
    n = len(families.moe_layer_ids(cfg)) * families.num_routed_experts(cfg)
    quant = getattr(families.text_config(cfg), "quantization_config", None) or getattr(
        cfg, "quantization_config", None) or {}
    if quant.get("quant_method") == "fp8" and quant.get("weight_block_size"):
        # experts.formats.FP8_BLOCK: one byte a weight, fp32 scales per bn x bk block
        bn, bk = quant["weight_block_size"]
        scales = 2 * -(-inter // bn) * -(-hidden // bk) + -(-hidden // bn) * -(-inter // bk)
        return n * (3 * hidden * inter + 4 * scales) / GIB
    return n * sum(s.row_bytes for s in specs.values()) / GIB


def vocab_size(model_path: str) -> int:
    """The model's vocabulary size (prompts of random token ids stay below it)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    return int(getattr(cfg, "vocab_size", None) or getattr(cfg.get_text_config(), "vocab_size"))


SYSTEMS = ("stock-gpu", "stock-offload", "ft-qstar", "ft-fill", "ft-cpu", "ft-allhit",
           "ft-fill-lru", "ft-fill-reserved")


def system_flags(name: str, args, pool_gib: float, trace_dir: str) -> List[str]:
    ratio = ["--freetoken-cache-ratio", str(args.cache_ratio)]
    record = ["--freetoken-record-routing", os.path.join(trace_dir, f"{name}.npz")]
    bw = ["--freetoken-bandwidth", args.bandwidth] if args.bandwidth else []
    if name == "stock-gpu":
        return []
    if name == "stock-offload":
        # SGLang's --cpu-offload-gb takes whole GiB (an int): the nearest to the pool's share
        # that FreeToken keeps off the GPU (40 for the Qwen3-30B-A3B shape's 40.5 at 25%).
        off = pool_gib * (1 - args.cache_ratio)
        gib = round(off)
        if gib < 1:
            raise ValueError(
                f"stock-offload: FreeToken keeps {off:.2f} GiB of experts off the GPU, which is "
                "0 whole GiB for SGLang's --cpu-offload-gb (Python's round), so it would run as "
                "stock-gpu; use a model whose off-GPU share is more than 0.5 GiB or a lower "
                "--cache-ratio")
        return ["--cpu-offload-gb", str(gib)]
    if name == "ft-allhit":
        return FT + ["--freetoken-cache-ratio", "1.0", "--freetoken-miss-policy", "fill"]
    if name == "ft-fill-lru":  # prefill through the decode LRU: the path before streaming
        return (FT + ratio + ["--freetoken-miss-policy", "fill", "--freetoken-prefill", "lru"]
                + record)
    if name == "ft-fill-reserved":
        return (FT + ratio + ["--freetoken-miss-policy", "fill", "--freetoken-prefill-buffers",
                              "reserved"] + record)
    if name.startswith("ft-"):
        policy = name[3:]
        return FT + ratio + ["--freetoken-miss-policy", policy] + (bw if policy == "qstar" else []) + record
    raise ValueError(f"unknown system {name!r}")


def roofline(runs: List[dict]) -> List[dict]:
    """Per FreeToken run and workload: the bound's tok/s and achieved / bound (see module)."""
    by = {r["label"]: r for r in runs}
    base = by.get("ft-allhit") or by.get("stock-gpu")
    bw = next(
        (r["freetoken"]["after"].get("bandwidth") for r in runs
         if r.get("freetoken") and r["freetoken"]["after"].get("bandwidth")),
        None,
    )
    rows = []
    for r in runs:
        if not r["label"].startswith("ft-") or r["label"] == "ft-allhit" or not r.get("freetoken"):
            continue
        expert_bytes = r["freetoken"]["after"]["pool"]["expert_bytes"]
        for name, w in r["workloads"].items():
            s, d = w["summary"], (w.get("freetoken") or {}).get("decode")
            tokens = (s.get("completion_tokens") or 0) - s.get("requests", 0)
            row = {"system": r["label"], "workload": name, "achieved_tok_s": s.get("mean_decode_tok_s")}
            # the all-hit step: the baseline's TPOT over the requests this run finished; its
            # workload summary when either run has no request records; no bound when both
            # have records but share no finished request
            both = base and _has_records(r) and _has_records(base)
            sh = _shared(r, base, name, "tpot_ms") if both else None
            if both:
                allhit = serve_bench.mean_of(sh[1]) if sh else None
            else:
                allhit = base and base["workloads"].get(name, {}).get("summary", {}).get("mean_tpot_ms")
            if d and tokens > 0 and bw and allhit:
                misses_per_token = (d["fills"] + d["cpu"]) / tokens
                t = allhit / 1e3 + misses_per_token * expert_bytes / (max(bw["B_P"], bw["B_H"]) * 1e9)
                row.update(
                    misses_per_token=misses_per_token,
                    allhit_tpot_ms=allhit,
                    allhit_from=base["label"],
                    allhit_compared=len(sh[1]) if sh else None,
                    bound_tok_s=1 / t,
                    achieved_over_bound=(row["achieved_tok_s"] or 0) * t,
                )
            rows.append(row)
    return rows


def roofline_markdown(rows: List[dict]) -> str:
    out = ["| system | workload | achieved tok/s | misses/token | all-hit TPOT ms (from) | bound tok/s | achieved / bound |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "bound_tok_s" not in r:
            out.append(f"| {r['system']} | {r['workload']} | {r['achieved_tok_s']} | - | - | - | - |")
            continue
        out.append(
            f"| {r['system']} | {r['workload']} | {r['achieved_tok_s']:.2f} | "
            f"{r['misses_per_token']:.1f} | {r['allhit_tpot_ms']:.2f} ({r['allhit_from']}"
            + (f", {r['allhit_compared']} req." if r.get("allhit_compared") else "") + ") | "
            f"{r['bound_tok_s']:.2f} | {r['achieved_over_bound']:.3f} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# Ratios against the best baseline
# ---------------------------------------------------------------------------------------

# Per workload: (summary key, column, higher is better).
WORKLOAD_METRICS = (
    ("mean_decode_tok_s", "decode tok/s ratio (best baseline)", True),
    ("mean_ttft_s", "mean TTFT ratio (lower is better)", False),
    ("worst_ttft_s", "worst TTFT ratio (lower is better)", False),
)
# Decode benchmark: (measure_decode key, column, higher is better).
DECODE_METRICS = (
    ("bs1_decode_tok_s", "bs1 ratio (best baseline)", True),
    ("bs4_total_tok_s", "bs4 ratio (best baseline)", True),
)
UNEQUAL_NOTE = ("† compared over workload summaries (a run without request records) of "
                "different numbers of requests, so the ratio compares different request sets.")


def is_baseline(label: str) -> bool:
    """Baselines are the systems whose label does not start with ``ft-``."""
    return not label.startswith("ft-")


def _num(x) -> Optional[float]:
    """A usable number: None for None, NaN and non-numbers."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(x) else float(x)


def best_baseline(runs: Sequence[dict], value: Callable[[dict], object],
                  higher: bool) -> Optional[Tuple[dict, float]]:
    """(run, value) of the baseline with the highest (``higher``) or lowest value; None when
    no baseline has a positive value. Ties go to the first."""
    cands = [(r, v) for r in runs if is_baseline(r["label"])
             for v in [_num(value(r))] if v is not None and v > 0]
    if not cands:
        return None
    pick = max if higher else min
    return pick(cands, key=lambda c: c[1])


def _workload_names(runs: Sequence[dict]) -> List[str]:
    names: List[str] = []
    for r in runs:
        names += [n for n in r.get("workloads", {}) if n not in names]
    return names


def _wsummary(run: dict, name: str) -> dict:
    return ((run.get("workloads") or {}).get(name) or {}).get("summary") or {}


def _ratio(v: Optional[float], best: Optional[Tuple[dict, float]]) -> dict:
    return {"value": v,
            "baseline": best[0]["label"] if best else None,
            "baseline_value": best[1] if best else None,
            "ratio": v / best[1] if best and v is not None else None}


# Per workload metric: the request-record field it aggregates over the compared requests, and how.
PER_REQUEST = {
    "mean_decode_tok_s": ("decode_tok_s", serve_bench.mean_of),
    "mean_ttft_s": ("ttft_s", serve_bench.mean_of),
    "worst_ttft_s": ("ttft_s", max),
}
SAME_REQUESTS_NOTE = ("Ratios over records compare the same requests: those of the workload "
                      "that both the system and that baseline finished with a value (\"3 of "
                      "17\" where fewer than all: cut by the budget, failed, or too short for a "
                      "rate). A request is matched by its index in the scripted session, its "
                      "max_tokens, message count and edits, so it is the same request in both "
                      "runs; requests cut by the budget count in neither TTFT nor decode.")


def _request_key(rec: dict) -> tuple:
    """What makes two request records the same request: the scripted session's index, its
    token cap, message count and context edits (the client supplies every assistant turn)."""
    return (rec["index"], rec.get("max_tokens"), rec.get("messages"), tuple(rec.get("edits") or ()))


def _has_records(run: dict) -> bool:
    """Whether a run carries request records (every run of ``serve_bench`` does; a
    hand-made or summary-only run does not)."""
    return bool(run.get("requests"))


def _records(run: dict, name: str) -> Optional[Dict[tuple, dict]]:
    """The finished requests of one workload of a run by ``_request_key``; None when the run
    carries no request records at all (a hand-made or summary-only run).

    Raises:
        ValueError: two finished requests share a key (the workload ran twice)."""
    if not _has_records(run):
        return None
    out: Dict[tuple, dict] = {}
    for r in run["requests"]:
        if r.get("workload") == name and not r.get("error"):
            key = _request_key(r)
            if key in out:
                raise ValueError(f"run {run.get('label')!r}: two finished requests of workload "
                                 f"{name} with the same index, token cap, messages and edits "
                                 f"{key}; a workload must run once per system")
            out[key] = r
    return out


def _shared(a: dict, b: dict, name: str, field: str) -> Optional[Tuple[List[float], List[float]]]:
    """``field`` of the requests of workload ``name`` that both runs finished with a value, as
    two lists in the same order; None when either run has no records or they share none."""
    ra, rb = _records(a, name), _records(b, name)
    if ra is None or rb is None:
        return None
    keys = sorted(k for k in ra.keys() & rb.keys()
                  if _num(ra[k].get(field)) is not None and _num(rb[k].get(field)) is not None)
    if not keys:
        return None
    return [ra[k][field] for k in keys], [rb[k][field] for k in keys]


def _pair(r: dict, b: dict, name: str, k: str) -> Optional[dict]:
    """Metric ``k`` of system ``r`` against baseline ``b`` on workload ``name``: over the
    requests both finished when both carry records, else over each one's summary (marked
    ``unequal_requests`` when their request counts differ). None without two positive values."""
    if _has_records(r) and _has_records(b):
        field, agg = PER_REQUEST[k]
        sh = _shared(r, b, name, field)
        if sh is None:
            return None
        v, bv, n, unequal = agg(sh[0]), agg(sh[1]), len(sh[0]), False
    else:
        v, bv = _num(_wsummary(r, name).get(k)), _num(_wsummary(b, name).get(k))
        n = None
        unequal = _wsummary(b, name).get("requests") != _wsummary(r, name).get("requests")
    if v is None or bv is None or bv <= 0:
        return None
    return {"value": v, "baseline": b["label"], "baseline_value": bv, "ratio": v / bv,
            "compared": n, "unequal_requests": unequal}


def ratios(runs: Sequence[dict]) -> List[dict]:
    """Per system and workload: for each of ``WORKLOAD_METRICS`` a dict ``value``,
    ``baseline`` (label of the best baseline for that workload and metric),
    ``baseline_value``, ``ratio`` (value / baseline_value; None without a baseline value),
    ``compared`` (how many requests the ratio covers; None for summaries) and
    ``unequal_requests``.

    Each system is paired with each baseline (``_pair``): over the requests both finished
    when both runs carry request records (every run of ``serve_bench``), else over their
    workload summaries. The best baseline is the one the system compares worst against:
    the lowest ratio for decode tok/s, the highest for TTFT, among the same-request pairs
    when there are any, else among the summary pairs."""
    rows = []
    for r in runs:  # in run order, as the serve_bench table
        for name in r.get("workloads", {}):
            s = _wsummary(r, name)
            row = {"system": r["label"], "workload": name, "requests": s.get("requests"),
                   "planned": s.get("planned"), "truncated": bool(s.get("truncated"))}
            for k, _, hi in WORKLOAD_METRICS:
                pairs = [p for b in runs if is_baseline(b["label"])
                         for p in [_pair(r, b, name, k)] if p is not None]
                # same-request comparisons, where there are any, before summary ones
                same = [p for p in pairs if p["compared"] is not None]
                if pairs:
                    c = (min if hi else max)(same or pairs, key=lambda p: p["ratio"])
                else:
                    c = {"value": _num(s.get(k)), "baseline": None, "baseline_value": None,
                         "ratio": None, "compared": None, "unequal_requests": False}
                row[k] = c
            rows.append(row)
    return rows


def _ratio_cell(c: dict, planned: Optional[int] = None) -> str:
    if c["ratio"] is None:
        return "-"
    part = (f"; {c['compared']} of {planned}"
            if c.get("compared") is not None and planned is not None and c["compared"] < planned
            else "")
    return f"{c['ratio']:.2f} ({c['baseline']}{part})" + (" †" if c.get("unequal_requests") else "")


def ratios_markdown(rows: List[dict]) -> str:
    """The ratio table of ``ratios(runs)``: per system and workload, each metric's value over
    the best baseline's, with that baseline's label and, where fewer than the workload's
    planned requests were compared, how many (``-`` without a baseline; † where summaries of
    different numbers of requests were compared)."""
    out = ["| system | workload | " + " | ".join(col for _, col, _ in WORKLOAD_METRICS) + " |",
           "|---|---|" + "---:|" * len(WORKLOAD_METRICS)]
    for r in rows:
        out.append(f"| {r['system']} | {r['workload']} | "
                   + " | ".join(_ratio_cell(r[k], r.get("planned")) for k, _, _ in WORKLOAD_METRICS)
                   + " |")
    if any(r[k].get("compared") is not None for r in rows for k, _, _ in WORKLOAD_METRICS):
        out += ["", SAME_REQUESTS_NOTE]
    if any(r[k].get("unequal_requests") and r[k]["ratio"] is not None
           for r in rows for k, _, _ in WORKLOAD_METRICS):
        out += ["", UNEQUAL_NOTE]
    return "\n".join(out)


def decode_ratios(runs: Sequence[dict]) -> List[dict]:
    """Per run with a decode benchmark: for each of ``DECODE_METRICS`` the ratio to the best
    baseline's (as ``ratios``)."""
    db = lambda r: r.get("decode_bench") or {}
    best = {k: best_baseline(runs, lambda r, k=k: db(r).get(k), hi) for k, _, hi in DECODE_METRICS}
    return [{"system": r["label"], **{k: _ratio(_num(db(r).get(k)), best[k])
                                      for k, _, _ in DECODE_METRICS}}
            for r in runs if r.get("decode_bench")]


def decode_markdown(runs: Sequence[dict]) -> str:
    """The decode-benchmark table (empty string when no run has one)."""
    measured = [r for r in runs if r.get("decode_bench")]
    if not measured:
        return ""
    ns = sorted({str(r["decode_bench"].get("new_tokens", "?")) for r in measured})
    lens = sorted({str(r["decode_bench"].get("input_len", 128)) for r in measured})
    ratio_rows = iter(decode_ratios(runs))  # one per measured run, in order
    fmt = lambda v, nd=3: "-" if _num(v) is None else f"{v:.{nd}f}"
    share = lambda w: w["cpu"] / w["reads"] if w.get("reads") else None
    cols = ["bs1 tok/s", "bs4 total tok/s", "hit rate bs1", "hit rate bs4", "CPU share bs1",
            "CPU share bs4"] + [col for _, col, _ in DECODE_METRICS]
    out = [f"Decode (random {'/'.join(lens)}-token prompts, {'/'.join(ns)} tokens, batch 1 and 4):",
           "", "| system | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for r in runs:
        d = r.get("decode_bench")
        if not d:
            out.append(f"| {r['label']} | not measured |" + " - |" * (len(cols) - 1))
            continue
        rr = next(ratio_rows)
        if d.get("error"):
            out.append(f"| {r['label']} | failed: {serve_bench.cell_text(d['error'], 120)} |"
                       + " - |" * (len(cols) - 1))
            continue
        w1, w4 = d.get("bs1_decode_counts") or {}, d.get("bs4_decode_counts") or {}
        cut = f" ({d['cut_requests']} requests cut at {d.get('max_request_s')} s)" if d.get("cut_requests") else ""
        if d.get("warmup_cut_requests"):
            cut += f" ({d['warmup_cut_requests']} warm-up requests cut)"
        out.append(
            f"| {r['label']}{cut} | {fmt(d.get('bs1_decode_tok_s'), 2)} | {fmt(d.get('bs4_total_tok_s'), 2)} "
            f"| {fmt(w1.get('hit_rate'))} | {fmt(w4.get('hit_rate'))} | {fmt(share(w1))} "
            f"| {fmt(share(w4))} | "
            + " | ".join(_ratio_cell(rr[k]) for k, _, _ in DECODE_METRICS) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------


def plot(runs: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = _workload_names(runs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        xs = [j + i * width for j in range(len(workloads))]
        summ = [_wsummary(r, w) for w in workloads]
        axes[0].bar(xs, [s.get("mean_decode_tok_s") or 0 for s in summ], width, label=r["label"])
        axes[1].bar(xs, [s.get("mean_ttft_s") or 0 for s in summ], width, label=r["label"])
        axes[2].bar(xs, [s.get("worst_ttft_s") or 0 for s in summ], width, label=r["label"])
    for ax, title in zip(axes, ("decode tok/s (mean)", "TTFT mean (s)", "TTFT worst (s)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))])
        ax.set_xticklabels(workloads)
        ax.set_title(title)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replay_traces(trace_dirs: Sequence[str], out_dir: str,
                  trace_files: Sequence[str] = ()) -> Optional[str]:
    """Replay every recorded trace, each once, through the cache policies together
    (``replay.py``): the ``.npz`` files of ``trace_dirs`` (this call's and those next to each
    ``--append`` file) and those of ``trace_files`` that exist (each run's
    ``--freetoken-record-routing`` path, which reaches runs appended more than one call back
    when they were recorded on this machine)."""
    found = [os.path.join(d, f) for d in trace_dirs if os.path.isdir(d)
             for f in os.listdir(d) if f.endswith(".npz")]
    found += [f for f in trace_files if os.path.isfile(f)]
    traces = sorted({os.path.realpath(f) for f in found})
    if not traces:
        return None
    import subprocess

    subprocess.run(
        [sys.executable, os.path.join(HERE, "replay.py"), *traces, "--out-dir", out_dir],
        check=True,
    )
    return out_dir


# The settings that make runs of different calls comparable (``--append`` refuses others).
COMPARABLE = ("shape", "model_path", "cache_ratio", "workloads", "scale", "decode_cap",
              "decode_bench", "budget_s")


def settings(a) -> dict:
    """The run_all settings recorded in each run (``run["run_all"]``)."""
    return {k: getattr(a, k) for k in COMPARABLE}


def load_appended(paths: Sequence[str], current: Optional[dict] = None
                  ) -> Tuple[List[dict], List[dict]]:
    """Runs and failed systems of earlier ``runs.json`` files (a single run, or
    ``{"runs": [...]}`` with an optional ``"errors": [...]``), in order; each run and failure
    is marked ``appended_from`` (the file).

    Raises:
        SystemExit: a file is not a run_all/serve_bench runs.json, or (with ``current``) one
            of its runs was made with other ``COMPARABLE`` settings, naming the flag.
    """
    runs, errors = [], []
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
            loaded = d["runs"] if isinstance(d, dict) and "runs" in d else [d]
            if not all(isinstance(r, dict) and "label" in r and "workloads" in r for r in loaded):
                raise ValueError("no runs in it")
        except (OSError, ValueError) as e:
            raise SystemExit(f"--append {p}: not a runs.json written by run_all.py or "
                             f"serve_bench.py ({e})")
        for r in loaded:
            theirs = r.get("run_all")
            if current is not None and theirs is not None:
                for k in COMPARABLE:
                    if theirs.get(k) != current[k]:
                        flag = "--" + k.replace("_", "-")
                        raise SystemExit(
                            f"--append {p}: its run {r['label']!r} used {flag} "
                            f"{theirs.get(k)!r}, this call {current[k]!r}; give the same {flag} "
                            "so that the runs compare")
            r["appended_from"] = p
        runs.extend(loaded)
        if isinstance(d, dict):
            errors.extend(dict(e, appended_from=p) for e in d.get("errors") or [])
    return runs, errors


def _fnum(x, nd: int) -> str:
    return "-" if _num(x) is None else f"{x:.{nd}f}"


def write_outputs(runs: List[dict], errors: List[dict], out_dir: str) -> str:
    """Write ``runs.json`` (``{"runs": [...], "errors": [...]}``), ``runs.md``,
    ``ratios.json``, ``roofline.json`` and ``report.md``; returns the report."""
    with open(os.path.join(out_dir, "runs.json"), "w") as f:
        json.dump({"runs": list(runs), "errors": list(errors)}, f, indent=1)
    md = serve_bench.markdown(runs, per_request=False)
    with open(os.path.join(out_dir, "runs.md"), "w") as f:
        f.write(md)
    ratio_rows = ratios(runs)
    roof = roofline(runs)
    systems_md = ["| system | start-up s | weights GB | peak GPU GiB load | peak GPU GiB serving |",
                  "|---|---|---|---|---|"]
    for r in runs:
        s = r.get("system") or {}
        systems_md.append(f"| {r['label']} | {_fnum(s.get('startup_s'), 1)} | "
                          f"{_fnum(s.get('weights_gb'), 2)} | {_fnum(s.get('peak_gpu_gib_load'), 2)} | "
                          f"{_fnum(s.get('peak_gpu_gib_serving'), 2)} |")
    parts = []
    if errors:
        ran = {r["label"] for r in runs}
        note = lambda e: (" (ran in another call: see its rows)" if e.get("label") in ran else "")
        rows = [f"| {e.get('label')}{note(e)} | {serve_bench.cell_text(e.get('error', ''))} |"
                for e in errors]
        parts.append("Failed systems (no numbers):\n\n| system | error |\n|---|---|\n"
                     + "\n".join(rows))
    if any(r.get("appended_from") for r in runs):
        parts.append("Runs of other calls (`--append`), same settings, possibly another machine "
                     "start: " + ", ".join(f"{r['label']} ({r['appended_from']})"
                                           for r in runs if r.get("appended_from")))
    parts += [md.rstrip("\n"),
              "Ratios against the best baseline in this run:\n\n" + ratios_markdown(ratio_rows)]
    dec = decode_markdown(runs)
    if dec:
        parts.append(dec)
    parts += ["\n".join(systems_md), "Roofline:\n\n" + roofline_markdown(roof)]
    report = "\n\n".join(parts)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(out_dir, "ratios.json"), "w") as f:
        json.dump({"workloads": ratio_rows, "decode_bench": decode_ratios(runs)}, f, indent=1)
    with open(os.path.join(out_dir, "roofline.json"), "w") as f:
        json.dump(roof, f, indent=1)
    return report


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------


def run_one(name: str, a, model: str, tokenizer_flags: List[str], pool_gib: float,
            trace_dir: str, sampler, vocab: int = 100000) -> dict:
    """Start one system's server, run the decode benchmark (``--decode-bench``) and the
    workloads on it, stop it; returns its run."""
    flags = (["--enable-cache-report", "--skip-server-warmup"] + tokenizer_flags
             + a.common.split() + system_flags(name, a, pool_gib, trace_dir))
    sampler.reset()
    t0 = time.time()
    with Server(model, flags, os.path.join(a.out_dir, f"{name}.log"), cpu=a.cpu,
                timeout=a.start_timeout) as server:
        load_peak = sampler.peak_gib()
        sampler.reset()
        decode = None
        if a.decode_bench > 0:
            t_d = time.time()
            try:
                decode = dict(bench_decode.measure_decode(
                    server.url, 128, a.decode_bench, 2, max_request_s=a.decode_bench_max_s,
                    vocab_size=vocab))
            except Exception as e:  # noqa: BLE001 - recorded; the workloads still run
                decode = {"error": f"{type(e).__name__}: {e}"}
            decode.update(input_len=128, new_tokens=a.decode_bench, repeats=2,
                          max_request_s=a.decode_bench_max_s,
                          wall_s=time.time() - t_d)
            print(f"{name}: decode bench {json.dumps(decode)}", flush=True)
        run = serve_bench.run_system(
            server.url, workloads=a.workloads.split(","), scale=a.scale, label=name,
            decode_cap=a.decode_cap, budget_s=a.budget_s,
        )
        if decode is not None:
            run["decode_bench"] = decode
        run["run_all"] = settings(a)
        run["system"] = {
            "flags": flags,
            "startup_s": server.startup_s,
            "peak_gpu_gib_load": load_peak,
            "peak_gpu_gib_serving": sampler.peak_gib(),
            "weights_gb": server.weights_gb(),
            "wall_s": time.time() - t0,
        }
    return run


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", help="a full-size shape served with dummy weights (servers.SHAPES)")
    src.add_argument("--model-path")
    ap.add_argument("--systems", default="stock-gpu,stock-offload,ft-qstar,ft-fill,ft-cpu",
                    help="comma-separated (given twice, the last counts)")
    ap.add_argument("--cache-ratio", type=float, default=0.25)
    ap.add_argument("--workloads", default="W1,W2,W4")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--decode-cap", type=int, default=None)
    ap.add_argument("--bandwidth", default=None, help="B_P,B_H for the FreeToken systems")
    ap.add_argument("--common", default="", help="flags for every server (space-separated)")
    ap.add_argument("--cpu", action="store_true", help="serve on the CPU (smoke runs)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--no-replay", action="store_true",
                    help="skip the replay of the recorded traces (run replay.py on them later)")
    ap.add_argument("--decode-bench", type=int, default=0, metavar="N",
                    help="per system, before the workloads: decode tok/s of N tokens at batch "
                         "1 and 4 on random 128-token prompts (0: off)")
    ap.add_argument("--decode-bench-max-s", type=float, default=20.0,
                    help="the decode benchmark cuts each request after this long, s (slow "
                         "systems); the rate then comes from the tokens seen")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="per system: wall-clock budget of its workloads, s, shared out "
                         "between the workloads (the table shows the cut)")
    ap.add_argument("--append", action="append", default=[], metavar="RUNS_JSON",
                    help="runs.json of an earlier run_all: its runs (and failed systems) come "
                         "first in this report (repeatable)")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    trace_dir = os.path.join(a.out_dir, "traces")
    os.makedirs(trace_dir, exist_ok=True)
    names = [n.strip() for n in a.systems.split(",") if n.strip()]
    bad = [n for n in names if n not in SYSTEMS]
    if bad:
        raise SystemExit(f"--systems: unknown {', '.join(bad)}; choose from {', '.join(SYSTEMS)}")
    for flag, v in (("--budget-s", a.budget_s), ("--decode-bench-max-s", a.decode_bench_max_s)):
        if v is not None and not v > 0:
            raise SystemExit(f"{flag} must be a positive number of seconds, not {v}")
    if a.decode_bench < 0 or a.decode_bench == 1:
        raise SystemExit(f"--decode-bench wants 0 (off) or at least 2 tokens, not {a.decode_bench}")
    wl = [w.strip() for w in a.workloads.split(",")]
    if len(set(wl)) != len(wl):
        raise SystemExit(f"--workloads {a.workloads}: a workload is named twice; name each once")
    if not names and not a.append:
        raise SystemExit("nothing to run or report: give --systems, or --append RUNS_JSON to "
                         "render an earlier run's report")
    runs, errors = load_appended(a.append, settings(a))
    taken = [r["label"] for r in runs]
    dup = sorted({n for n in taken if taken.count(n) > 1} | (set(taken) & set(names)))
    if dup:
        raise SystemExit(f"--append: system {', '.join(dup)} would appear twice; drop it from "
                         "--systems or from the appended runs")
    n_appended_errors = len(errors)
    if a.append:
        print(f"appended {len(runs)} runs ({', '.join(r['label'] for r in runs)}) and "
              f"{len(errors)} failed systems from {', '.join(a.append)}", flush=True)
    if a.shape:
        model = write_shape(a.shape, a.out_dir)
        tokenizer_flags = ["--load-format", "dummy"]
        from servers import SHAPES

        if "tokenizer" not in SHAPES[a.shape]:
            # Dummy weights come with no tokenizer: the chat endpoint needs one, so the tiny
            # models' tokenizer (vocabulary far smaller than the model's) renders prompts.
            from freetoken_sglang.tiny_models import build_tiny_checkpoint

            tok = build_tiny_checkpoint("qwen3_moe", os.path.join(a.out_dir, "tokenizer"))
            tokenizer_flags += ["--tokenizer-path", tok]
    else:
        model, tokenizer_flags = a.model_path, []
    pool_gib = expert_pool_gib(model)
    vocab = vocab_size(model)
    sampler = GpuMemorySampler()
    try:
        for name in names:
            t0 = time.time()
            try:
                run = run_one(name, a, model, tokenizer_flags, pool_gib, trace_dir, sampler, vocab)
            except Exception as e:  # noqa: BLE001 - one failing system must not lose the others
                errors.append({"label": name, "error": f"{type(e).__name__}: {e}"})
                print(f"{name}: FAILED after {time.time() - t0:.0f} s: {type(e).__name__}: {e}",
                      flush=True)
            else:
                runs.append(run)
                s = run["summary"]
                cut = f", cut at {s['requests']}/{s['planned']} requests" if s.get("truncated") else ""
                print(f"{name}: done in {time.time() - t0:.0f} s{cut}", flush=True)
            write_outputs(runs, errors, a.out_dir)  # a run stopped later keeps these systems
    finally:
        sampler.close()
    report = write_outputs(runs, errors, a.out_dir)
    if runs:
        plot(runs, os.path.join(a.out_dir, "serving.png"))
    if not a.no_replay:
        recorded = [f[i + 1] for r in runs for f in [(r.get("system") or {}).get("flags") or []]
                    for i, x in enumerate(f[:-1]) if x == "--freetoken-record-routing"]
        replay_traces([trace_dir] + [os.path.join(os.path.dirname(os.path.abspath(p)), "traces")
                                     for p in a.append], os.path.join(a.out_dir, "replay"),
                      recorded)
    print(report)
    return 1 if len(errors) > n_appended_errors else 0  # this call's failures only


if __name__ == "__main__":
    stop_servers_on_sigterm()  # here, not in main(): tests call main() inside pytest
    sys.exit(main())
