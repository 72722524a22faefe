"""Decode benchmark on a full-size MoE shape with dummy weights: stock SGLang (every expert on
the GPU) against FreeToken configurations, side by side in one run.

Each system is a real ``python -m sglang.launch_server`` (``--load-format dummy``); the
script measures start-up time, peak GPU memory (nvidia-smi, sampled) during load and while
serving (from the warm-up request on), and decode tok/s at batch 1 and 4 from streamed ``/generate`` requests, then prints
a table with ratios against the first system.

    python benchmarks/bench_decode.py --shape qwen3-30b-a3b \\
        --system stock: --system ft25:--enable-freetoken,--freetoken-cache-ratio,0.25

With ``--cache-ratios`` each FreeToken server is resized to each ratio in turn; with
``--then LABEL=POLICY[,FLAG,VALUE]`` the last FreeToken server then changes its miss policy
(POST /freetoken/cache, back at its starting size) and measures the ratios again, once per
``--then``: one server start for several policies (it must start with qstar or cpu).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_bench  # noqa: E402
from serve_bench import freetoken_stats  # noqa: E402
from servers import SHAPES, GpuMemorySampler, Server, stop_servers_on_sigterm, write_shape  # noqa: E402

def stream_generate(url: str, input_ids: List[int], new_tokens: int,
                    max_s: Optional[float] = None) -> Dict[str, object]:
    """One streamed ``/generate`` request of ``new_tokens`` greedy tokens (``ignore_eos``).

    Returns ``ttft_s`` (s, None if no token came), ``decode_tok_s`` (tokens after the first
    over their time; None with fewer than 2 tokens), ``tokens`` and ``cut``. With ``max_s``
    (s), the request is cut once it has run that long, also while waiting for a token: the
    stream is closed and the request aborted on the server (``POST /abort_request``), and the
    rates come from the tokens seen.

    Raises:
        requests.HTTPError: the server refused the request.
        requests.ConnectionError: the server is not reachable.
    """
    t0 = time.perf_counter()
    first = last = rid = None
    n, cut = 0, False
    try:
        with requests.post(
            url + "/generate",
            json={
                "input_ids": input_ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,
                                    "ignore_eos": True},
                "stream": True,
            },
            stream=True,
            timeout=(10, max_s if max_s is not None else 1800),  # (connect, between reads)
        ) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                now = time.perf_counter()
                meta = msg.get("meta_info", {})
                rid = meta.get("id", rid)
                count = meta.get("completion_tokens", n)
                if count > n:
                    if first is None:
                        first = now
                    last = now
                    n = count
                if max_s is not None and now - t0 > max_s and n < new_tokens:
                    cut = True
                    break
    except requests.exceptions.ReadTimeout:
        if max_s is None:
            raise
        cut = True
    if cut and rid is not None:
        try:  # SGLang notices a closed stream only later; free the batch slot now
            requests.post(url + "/abort_request", json={"rid": rid}, timeout=10)
        except requests.RequestException:
            pass
    decode = (n - 1) / (last - first) if n > 1 and last > first else None
    return {"ttft_s": (first - t0) if first is not None else None,
            "decode_tok_s": decode, "tokens": n, "cut": cut}


def concurrently(fn, items: list) -> list:
    """``[fn(x) for x in items]`` (``items`` not empty), all at once on threads; re-raises the
    first exception of ``fn``, after the other calls have ended. On SIGTERM's SystemExit (or
    any other non-``Exception``) it returns at once, without waiting for the requests in
    flight, so that the caller's ``Server`` is stopped next; their threads end with it."""
    ex = ThreadPoolExecutor(len(items))
    try:
        out = list(ex.map(fn, items))
    except BaseException as e:
        ex.shutdown(wait=isinstance(e, Exception), cancel_futures=True)
        raise
    ex.shutdown(wait=True)
    return out


def measure_decode(url: str, input_len: int, new_tokens: int, repeats: int,
                   seed: int = 0, max_request_s: Optional[float] = None,
                   vocab_size: int = 100000) -> Dict[str, object]:
    """Decode speed of a running server: a warm-up request and a warm-up batch of 4 (their
    misses fill the cache), then ``repeats`` requests at batch 1 and 4 concurrent requests,
    on prompts of ``input_len`` random token ids below ``vocab_size``, ``new_tokens`` greedy
    tokens each.

    Returns ``bs1_decode_tok_s`` (mean of the per-request tok/s, over requests with at least
    2 tokens; ``bs1_rated`` says how many), ``bs1_ttft_s`` (s), ``bs4_decode_tok_s_per_req``,
    ``bs4_total_tok_s`` (all tokens of the 4 / wall time), ``cut_requests`` (cut at
    ``max_request_s`` s, for slow systems such as ``--cpu-offload-gb``),
    ``warmup_cut_requests`` (warm-up requests cut likewise; a cut request is aborted, and its
    last steps may still run in the batch-1 window) and, on a FreeToken server, the
    decode-phase counters of each window (``bs1_decode_counts``, ``bs4_decode_counts``). Rates are None when no request gave one.

    Raises:
        ValueError: ``repeats`` < 1, ``new_tokens`` < 2 or ``max_request_s`` <= 0.
        requests.HTTPError: the server refused a request.
    """
    if repeats < 1 or new_tokens < 2 or (max_request_s is not None and max_request_s <= 0):
        raise ValueError("measure_decode needs repeats >= 1, new_tokens >= 2 and a positive "
                         f"max_request_s (got {repeats}, {new_tokens}, {max_request_s})")
    rng = random.Random(seed)
    hi = max(2, min(100000, vocab_size))
    prompt = lambda: [rng.randrange(min(1000, hi // 2), hi) for _ in range(input_len)]
    # Warm-up at batch 1 and at batch 4: the first batched prefill and decode of a server
    # compile or tune kernels for those shapes (on the H200, 2026-11-30, stock SGLang's first
    # 4-request batch took about 2.4 s more than its decode), which is not decode time.
    warm = [stream_generate(url, prompt(), 16, max_request_s)]
    warm += concurrently(lambda p: stream_generate(url, p, 16, max_request_s),
                         [prompt() for _ in range(4)])
    result: Dict[str, object] = {}
    before_bs1 = freetoken_stats(url)
    b1 = [stream_generate(url, prompt(), new_tokens, max_request_s) for _ in range(repeats)]
    before_bs4 = freetoken_stats(url)
    result["bs1_decode_tok_s"] = serve_bench.mean_of(r["decode_tok_s"] for r in b1)
    result["bs1_rated"] = sum(r["decode_tok_s"] is not None for r in b1)
    result["bs1_ttft_s"] = serve_bench.mean_of(r["ttft_s"] for r in b1)
    prompts = [prompt() for _ in range(4)]
    t_b = time.perf_counter()
    b4 = concurrently(lambda p: stream_generate(url, p, new_tokens, max_request_s), prompts)
    wall = time.perf_counter() - t_b
    result["bs4_decode_tok_s_per_req"] = serve_bench.mean_of(r["decode_tok_s"] for r in b4)
    result["bs4_total_tok_s"] = sum(r["tokens"] for r in b4) / wall
    result["cut_requests"] = sum(r["cut"] for r in b1 + b4)
    result["warmup_cut_requests"] = sum(r["cut"] for r in warm)
    after = freetoken_stats(url)
    if after is not None:
        # Counters of the decode-sized layer calls during each measurement.
        result["bs1_decode_counts"] = window(before_bs1, before_bs4)
        result["bs4_decode_counts"] = window(before_bs4, after)
    return result


# --then's flags and the POST /freetoken/cache keys they become
THEN_FLAGS = {"--freetoken-admission": "admission", "--freetoken-fill-reused": "fill_reused",
              "--freetoken-return-rule": "return_rule", "--freetoken-late-fill": "late_fill",
              "--freetoken-host-rates": "host_rates"}


def parse_then(spec: str):
    """``LABEL=POLICY[,FLAG,VALUE...]`` -> ``(LABEL, body)`` for POST /freetoken/cache.

    Raises:
        SystemExit: a flag other than ``THEN_FLAGS``' or a bad value (one line).
    """
    from freetoken_sglang.control import parse_body

    label, _, rest = spec.partition("=")
    parts = [p for p in rest.split(",") if p]
    if not label or not parts or len(parts) % 2 != 1:
        raise SystemExit(f"--then {spec!r}: give LABEL=POLICY[,FLAG,VALUE...]")
    body = {"miss_policy": parts[0]}
    for flag, value in zip(parts[1::2], parts[2::2]):
        if flag not in THEN_FLAGS:
            raise SystemExit(f"--then {spec!r}: {flag} cannot change while serving; use "
                             f"{' or '.join(THEN_FLAGS)}")
        body[THEN_FLAGS[flag]] = value
    try:
        return label, parse_body(body)
    except ValueError as e:
        raise SystemExit(f"--then {spec!r}: {e}") from None


def measure_ratios(url: str, label: str, ratios, rows: int, args) -> list:
    """One cell per cache ratio: resize (POST /freetoken/cache), then measure_decode."""
    cells = []
    for ratio in ratios:
        slots = max(1, round(ratio * rows))
        t0 = time.perf_counter()
        r = requests.post(url + "/freetoken/cache", json={"slots": slots}, timeout=600)
        answer = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
        cell = {"ratio": ratio, "slots": slots, "resize_status": r.status_code,
                "resize_s": time.perf_counter() - t0, "resize_answer": answer}
        if r.status_code == 200:
            cell.update(measure_decode(url, args.input_len, args.new_tokens,
                                       args.repeats, max_request_s=args.max_request_s))
        cells.append(cell)
        print(json.dumps({"label": label, **{k: cell.get(k) for k in (
            "ratio", "slots", "resize_s", "bs1_decode_tok_s", "bs4_total_tok_s")}}),
              flush=True)
    return cells


def ft_summary(s: dict) -> dict:
    """The parts of ``/freetoken/stats`` a result keeps."""
    return {
        "total": s["total"],
        "decode": s.get("decode"),
        "cache_slots": s["cache"]["slots"],
        "pool_experts": s["pool"]["experts"],
        "expert_bytes": s["pool"].get("expert_bytes"),
        "miss_policy": s.get("miss_policy"),
        "admission": s.get("admission"),
        "fill_reused": s.get("fill_reused"),
        "return_rule": s.get("return_rule"),
        "host_rates": s.get("host_rates"),
        "return_rate": (s.get("cache") or {}).get("return_rate"),
        "late_fill": s.get("late_fill"),
        "late_fills": (s.get("cache") or {}).get("late_fills"),
        "bandwidth": s.get("bandwidth"),
        "load": s["load"],
    }


def run_system(label, model_path, flags, args, sampler, log_dir,
               then=()) -> List[Dict[str, object]]:
    """Start one system, measure it (and each ``then`` policy on it: ``parse_then``'s
    pairs), stop it; one result per policy measured."""
    flags = [
        "--load-format", "dummy", "--skip-tokenizer-init",
        "--attention-backend", "triton", "--sampling-backend", "pytorch",
        "--cuda-graph-max-bs", str(args.max_bs), "--max-running-requests", str(args.max_bs),
        "--context-length", str(args.context_length), "--skip-server-warmup",
        *args.common.split(), *flags,
    ]
    sampler.reset()
    result: Dict[str, object] = {"label": label, "flags": " ".join(flags)}
    with Server(model_path, flags, os.path.join(log_dir, f"{label}.log"),
                timeout=args.start_timeout) as server:
        url = server.url
        result["startup_s"] = server.startup_s
        result["peak_gpu_gib_load"] = sampler.peak_gib()
        sampler.reset()
        ratios = [float(x) for x in (args.cache_ratios or "").split(",") if x]
        stats = freetoken_stats(url) if ratios else None
        switched = []
        if stats is not None:
            # One server, several cache sizes: resize (POST /freetoken/cache) before each
            # measurement; the cache keeps its most recently used experts across a shrink.
            rows, start_slots = stats["pool"]["experts"], stats["cache"]["slots"]
            if args.warm_cell:
                # the first cell after a server start paid stalls (Session 28: bs1 TTFT 0.6 s
                # against 0.09, bs4 total about half): run it once unmeasured
                result["warm_cell"] = measure_ratios(url, label + " (warm-up)", ratios[:1],
                                                     rows, args)[0]
            result["by_ratio"] = measure_ratios(url, label, ratios, rows, args)
            first = result["by_ratio"][0]
            result.update({k: v for k, v in first.items() if k.startswith(("bs1", "bs4"))})
            result["freetoken"] = ft_summary(freetoken_stats(url))
            then_log = os.path.join(log_dir, f"{label}.then.jsonl")
            if then and os.path.exists(then_log):
                os.remove(then_log)  # this run's policies only
            for then_label, body in then:
                # back to the starting size (a cache that held every expert keeps the same
                # share of every layer at the next shrink, as at start), in the new policy
                t0 = time.perf_counter()
                r = requests.post(url + "/freetoken/cache", json={"slots": start_slots, **body},
                                  timeout=600)
                answer = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
                other = {"label": then_label, "flags": result["flags"], "then": body,
                         "switch_s": time.perf_counter() - t0, "switch_answer": answer,
                         "startup_s": None}
                if r.status_code != 200:
                    other["error"] = f"policy change refused: {answer}"
                else:
                    other["by_ratio"] = measure_ratios(url, then_label, ratios, rows, args)
                    first = other["by_ratio"][0]
                    other.update({k: v for k, v in first.items() if k.startswith(("bs1", "bs4"))})
                    other["freetoken"] = ft_summary(freetoken_stats(url))
                switched.append(other)
                # as it goes: a call that runs out of time keeps the policies measured so far
                with open(then_log, "a") as f:
                    f.write(json.dumps(other) + "\n")
        else:
            result.update(measure_decode(url, args.input_len, args.new_tokens, args.repeats,
                                         max_request_s=args.max_request_s))
        result["peak_gpu_gib_serving"] = sampler.peak_gib()
        s = freetoken_stats(url)
        if s is not None and "freetoken" not in result:
            result["freetoken"] = ft_summary(s)
        m = re.search(r"Peak GPU memory during load: ([0-9.]+) GiB", server.log())
        if m:
            result["torch_peak_gib_during_load"] = float(m.group(1))
        result["sglang_weight_gb"] = server.weights_gb()
    for other in switched:
        other.update({k: result.get(k) for k in ("peak_gpu_gib_load", "peak_gpu_gib_serving",
                                                 "sglang_weight_gb")})
    return [result, *switched]


def window(before: dict, after: dict) -> Dict[str, object]:
    """Decode-phase counter differences between two ``/freetoken/stats`` documents, with
    the window's hit rate."""
    d = {f: after["decode"][f] - before["decode"][f]
         for f in ("reads", "hits", "fills", "evictions", "cpu")}
    d["hit_rate"] = d["hits"] / d["reads"] if d["reads"] else None
    return d


def table(results: List[Dict[str, object]]) -> str:
    """Markdown table; ratios are against the first system measured without an error."""
    base = next((r for r in results if not r.get("error")), results[0])
    nan = float("nan")
    num = lambda r, k: r.get(k) if r.get(k) is not None else nan
    cols = [
        ("startup_s", "start-up s"),
        ("peak_gpu_gib_load", "peak GPU GiB load"),
        ("peak_gpu_gib_serving", "peak GPU GiB serving"),
        ("sglang_weight_gb", "weights GB (SGLang)"),
    ]
    lines = ["| system | decode tok/s bs1 | decode tok/s bs4 (total) | bs1 ratio vs "
             f"{base['label']} | bs4 ratio | " + " | ".join(c[1] for c in cols)
             + " | hit rate bs1 | hit rate bs4 | CPU share bs1 | CPU share bs4 |"]
    lines.append("|" + "---|" * (len(cols) + 9))
    fmt = lambda v: f"{v:.3f}" if v is not None else "-"
    share = lambda w: w["cpu"] / w["reads"] if w.get("reads") else None
    def rows_of(r):  # one row per cache size of a --cache-ratios system
        if not r.get("by_ratio"):
            return [r]
        out = []
        for cell in r["by_ratio"]:
            label = f"{r['label']}@{cell['ratio']:g}"
            if cell.get("resize_status") == 200:
                out.append({**r, **cell, "label": label})
            else:
                out.append({"label": label, "error": f"resize refused: {cell.get('resize_answer')}"})
        return out

    for r in [row for r in results for row in rows_of(r)]:
        if r.get("error"):
            lines.append(f"| {r['label']} | failed: {serve_bench.cell_text(r['error'], 120)} |"
                         + " - |" * (len(cols) + 7))
            continue
        w1, w4 = r.get("bs1_decode_counts") or {}, r.get("bs4_decode_counts") or {}
        lines.append(
            f"| {r['label']} | {num(r, 'bs1_decode_tok_s'):.2f} | {num(r, 'bs4_total_tok_s'):.2f} | "
            f"{num(r, 'bs1_decode_tok_s') / num(base, 'bs1_decode_tok_s'):.3f} | "
            f"{num(r, 'bs4_total_tok_s') / num(base, 'bs4_total_tok_s'):.3f} | "
            + " | ".join(f"{num(r, k):.2f}" for k, _ in cols)
            + f" | {fmt(w1.get('hit_rate'))} | {fmt(w4.get('hit_rate'))} | {fmt(share(w1))} | {fmt(share(w4))} |"
        )
    return "\n".join(lines)


def is_stock(result: Dict[str, object]) -> bool:
    """Whether a result is stock SGLang with every expert on the GPU: neither FreeToken nor
    SGLang's ``--cpu-offload-gb``."""
    flags = str(result.get("flags", "")).split()
    return "--enable-freetoken" not in flags and not any(
        f.startswith("--cpu-offload-gb") for f in flags)


def roofline(results: List[Dict[str, object]], new_tokens: int, repeats: int,
             expert_bytes: float, bandwidth: Optional[dict] = None) -> str:
    """Markdown table of each ``--cache-ratios`` cell against its roofline bound (issue 14):
    the all-hit step time (the same system's cell at ratio 1.0, else stock SGLang's in these
    results, ``is_stock``: the "all-hit from" column says which) plus the step's missed bytes
    over max(B_P, B_H), counted after the GPU's step: misses run on the CPU overlap it, so a
    cell with CPU work can exceed its "bound". Since the resident executor (session 16) the
    1.0 cell runs stock SGLang's MoE, so the LRU path's fixed cost per layer call counts
    against a cell's ratio; bounds before it used the LRU path at 100% hits. Steps per
    window: ``repeats * (new_tokens - 1)`` at batch 1 and ``new_tokens - 1`` at batch 4 (the
    first token of a request comes from its prefill).
    B_P, B_H: the system's own measurement, else ``bandwidth`` (another system's)."""
    lines = ["| system | cache | bs1 tok/s | bs1 bound | bs1 / bound | bs4 tok/s | bs4 bound "
             "| bs4 / bound | all-hit from |", "|---|---|---|---|---|---|---|---|---|"]
    stock = next((r for r in results if is_stock(r) and r.get("bs1_decode_tok_s")), None)
    for r in results:
        cells = {c["ratio"]: c for c in r.get("by_ratio") or [] if c.get("resize_status") == 200}
        full, source = cells.get(1.0), f"{r['label']}@1"
        if not full and cells and stock:
            full, source = stock, stock["label"]
        bw = ((r.get("freetoken") or {}).get("bandwidth") or bandwidth)
        if not full or not bw:
            continue
        b = max(bw["B_P"], bw["B_H"]) * 1e9
        for ratio, c in sorted(cells.items(), reverse=True):
            row = [r["label"], f"{ratio:g}"]
            for key, rate, steps, per_step in (
                    ("bs1_decode_counts", "bs1_decode_tok_s", repeats * (new_tokens - 1), 1),
                    ("bs4_decode_counts", "bs4_total_tok_s", new_tokens - 1, 4)):
                w, got, t_hit = c.get(key), c.get(rate), full.get(rate)
                if not w or not got or not t_hit:
                    row += ["-", "-", "-"]
                    continue
                t_step = per_step / t_hit + (w["reads"] - w["hits"]) / steps * expert_bytes / b
                bound = per_step / t_step
                row += [f"{got:.2f}", f"{bound:.2f}", f"{got / bound:.3f}"]
            lines.append("| " + " | ".join(row + [source]) + " |")
    return "\n".join(lines)


def report(paths: List[str]) -> None:
    """Print the tables of one or more ``bench_decode.json`` files, systems in order (the
    first file's first system is the ratios' base)."""
    results, args = [], None
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        results += doc["results"]
        args = args or doc["args"]
    print(table(results))
    bw = next(((r.get("freetoken") or {}).get("bandwidth") for r in results
               if (r.get("freetoken") or {}).get("bandwidth")), None)
    eb = next(((r.get("freetoken") or {}).get("expert_bytes") for r in results
               if (r.get("freetoken") or {}).get("expert_bytes")), None)
    if eb is None:
        c = SHAPES[args["shape"]]  # (older files) a BF16 gated expert: 3 * H * I * 2 bytes
        eb = 3 * c["hidden_size"] * c["moe_intermediate_size"] * 2
    if eb and bw:
        print()
        print(roofline(results, args["new_tokens"], args["repeats"], eb, bw))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument(
        "--system", action="append", default=None,
        help="LABEL:FLAG,FLAG,... (comma-separated extra launch_server flags)",
    )
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-bs", type=int, default=8)
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--common", default="--disable-prefill-cuda-graph --max-total-tokens 16384",
                    help="flags given to every system (space-separated)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--max-request-s", type=float, default=None,
                    help="cut each request after this many seconds (slow systems such as "
                         "--cpu-offload-gb); cut requests are counted in the results")
    ap.add_argument("--cache-ratios", default=None,
                    help="comma-separated fractions of the pool: on each FreeToken server, resize "
                         "the cache to each in turn (POST /freetoken/cache) and measure there; "
                         "give them in decreasing order so that every resize is a shrink")
    ap.add_argument("--no-warm-cell", dest="warm_cell", action="store_false",
                    help="with --cache-ratios: measure the first ratio right after the server "
                         "starts (default: its cell runs once unmeasured first, its numbers kept "
                         "as warm_cell)")
    ap.add_argument("--then", action="append", default=[], metavar="LABEL=POLICY[,FLAG,VALUE]",
                    help="with --cache-ratios: after the last FreeToken system's ratios, change "
                         "its miss policy (POLICY fill, qstar or cpu; FLAG --freetoken-admission, "
                         "--freetoken-fill-reused, --freetoken-return-rule, --freetoken-late-fill "
                         "or --freetoken-host-rates) at its starting "
                         "size and measure the ratios again, as the system LABEL; "
                         "repeatable. That server must start with qstar or cpu")
    ap.add_argument("--out-dir", default=None, help="default: a new ft-bench-* temporary dir")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON",
                    help="print the tables (and the roofline table) of these bench_decode.json "
                         "files and exit; --system is then not needed")
    a = ap.parse_args(argv)
    if a.report:
        report(a.report)
        return
    if not a.system:
        ap.error("--system is required (or --report JSON...)")
    then = [parse_then(t) for t in a.then]
    if then and not a.cache_ratios:
        ap.error("--then needs --cache-ratios")
    # --then runs on the last FreeToken system
    ft = [i for i, spec in enumerate(a.system)
          if "--enable-freetoken" in spec.partition(":")[2].split(",")]
    if then and not ft:
        ap.error("--then needs a FreeToken system (--enable-freetoken)")
    if a.max_request_s is not None and not (math.isfinite(a.max_request_s) and a.max_request_s > 0):
        raise SystemExit(f"--max-request-s must be a positive number of seconds, not {a.max_request_s}")
    a.out_dir = a.out_dir or tempfile.mkdtemp(prefix="ft-bench-")
    os.makedirs(a.out_dir, exist_ok=True)
    model = write_shape(a.shape, a.out_dir)
    sampler = GpuMemorySampler()
    results = []
    try:
        for i, spec in enumerate(a.system):
            label, _, flags = spec.partition(":")
            try:
                rs = run_system(label, model, [f for f in flags.split(",") if f], a, sampler,
                                a.out_dir, then=then if ft and i == ft[-1] else ())
            except Exception as e:  # one failing system must not lose the others' numbers
                rs = [{"label": label, "error": f"{type(e).__name__}: {e}"}]
            for r in rs:
                print(json.dumps(r), flush=True)
            results += rs
            with open(os.path.join(a.out_dir, "bench_decode.json"), "w") as f:
                json.dump({"shape": a.shape, "args": vars(a), "results": results}, f, indent=1)
    finally:
        sampler.close()
    print(table(results))
    with open(os.path.join(a.out_dir, "bench_decode.md"), "w") as f:
        f.write(table(results) + "\n")
    if a.cache_ratios:
        print()
        report([os.path.join(a.out_dir, "bench_decode.json")])


if __name__ == "__main__":
    stop_servers_on_sigterm()  # here, not in main(): tests call main() inside pytest
    main()
