"""Prefill benchmark: prefill tok/s against prompt length for stock SGLang and FreeToken's
prefill paths, side by side in one run, with the ceiling of one pool pass over PCIe per chunk
(paper §3.1, Fig. 4a).

Each system is a real ``launch_server`` with dummy weights of a full-size shape. Per prompt
length, one untimed request of that length first (the server's first request of a token
count compiles kernels), then one request of fresh random token ids (no radix-cache hit)
with one new token, timed end to end (TTFT); the FreeToken counters of that request (streamed
and reused experts, LRU fills and evictions, the measured copy wait) are recorded with it.
``--working-set`` measures whether decode after a long prefill refills its working set: a
128-token prompt A decodes 32 tokens, A again (its working set is resident: the fills of a
repeat), then a ``--working-set-len`` prompt B, then A again; the LRU fills of each A and
B's borrowed-buffer evictions are recorded. ``--short`` lengths
measure the crossover between streaming and the LRU path. B_P is measured here first (a
pinned 2 GiB host-to-device copy), and the ceiling of a prompt of P tokens is
``P / (ceil(P / chunk) * pool_bytes / B_P)``.

    python benchmarks/bench_prefill.py --out-dir OUT --cache-ratio 0.25 \\
        --systems stock,ft-stream,ft-stream1,ft-lru
    python benchmarks/bench_prefill.py --report OUT/prefill.json     # table and plot again

Systems: ``stock`` (every expert on the GPU), ``ft-stream`` (double-buffered streaming into
buffers borrowed from the LRU; with ``--freetoken-stream-min-tokens 1`` so that the short
prompts stream too: for prompts over the crossover it is the default), ``ft-reserved``
(the same with buffers reserved outside the LRU), ``ft-stream1`` (one buffer: no overlap),
``ft-lru`` (prefill through the decode LRU, the path before streaming), ``ft-pcpu-V``
(streaming with ``--freetoken-prefill-cpu V``: ``auto`` or a fraction of each layer's
non-resident experts run by the C executor), ``ft-pcpu-V-ISA`` (the same with
``--freetoken-cpu-isa ISA``, e.g. ``ft-pcpu-auto-amx``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from typing import Dict, List, Optional

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import freetoken_stats  # noqa: E402
from servers import Server, stop_servers_on_sigterm, write_shape  # noqa: E402

FT = ["--enable-freetoken"]
SYSTEMS = {
    "stock": [],
    "ft-stream": FT + ["--freetoken-stream-min-tokens", "1"],
    "ft-reserved": FT + ["--freetoken-stream-min-tokens", "1", "--freetoken-prefill-buffers",
                         "reserved"],
    "ft-stream1": FT + ["--freetoken-stream-buffers", "1"],
    "ft-lru": FT + ["--freetoken-prefill", "lru"],
}


def measure_b_p(gib: float = 2.0) -> Optional[float]:
    """GB/s of one pinned host-to-device copy of ``gib`` GiB (copy engine), or None without
    CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = int(gib * (1 << 30))
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    dev.copy_(host, non_blocking=True)
    b.record()
    b.synchronize()
    rate = n / (a.elapsed_time(b) / 1e3) / 1e9
    del host, dev
    torch.cuda.empty_cache()
    return rate


def prefill_once(url: str, ids: List[int], timeout: float, new_tokens: int = 1) -> float:
    """Seconds from sending a greedy ``/generate`` of ``ids`` with ``new_tokens`` new tokens
    (EOS ignored) to its answer."""
    t0 = time.perf_counter()
    r = requests.post(
        url + "/generate",
        json={"input_ids": ids, "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                    "max_new_tokens": new_tokens}},
        timeout=timeout,
    )
    r.raise_for_status()
    return time.perf_counter() - t0


def lru_fills(delta: Optional[dict]) -> Optional[int]:
    """LRU fills (decode and prefill phases) in a counter delta of ``_delta``."""
    if delta is None:
        return None
    return int(sum((delta.get(g) or {}).get("fills", 0) for g in ("decode", "prefill")))


def working_set(url: str, rng: random.Random, a) -> Dict[str, object]:
    """A (128 tokens, 32 new), A again, B (``--working-set-len`` tokens, 1 new), A again: the
    LRU fills of each request, and what B did to the LRU (see the module docstring)."""
    A = [rng.randrange(a.vocab) for _ in range(128)]
    B = [rng.randrange(a.vocab) for _ in range(a.working_set_len)]
    out: Dict[str, object] = {"a_tokens": 128, "a_new": 32, "b_tokens": len(B)}
    for name, ids, new in (("a1", A, 32), ("a2", A, 32), ("b", B, 1), ("a3", A, 32)):
        before = freetoken_stats(url)
        secs = prefill_once(url, ids, a.request_timeout, new)
        d = _delta(before, freetoken_stats(url))
        out[name] = {"s": secs, "lru_fills": lru_fills(d), "counters": d}
    return out


def _delta(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    if before is None or after is None:
        return None
    out = {}
    for group in ("prefill_stream", "prefill", "decode"):
        a, b = after.get(group) or {}, before.get(group) or {}
        out[group] = {k: a[k] - b.get(k, 0) for k in a if isinstance(a[k], (int, float))
                      and not isinstance(a[k], bool) and k != "hit_rate"}
    return out


def run_system(label: str, model: str, flags: List[str], a, log_dir: str) -> Dict[str, object]:
    rng = random.Random(f"{label}-{a.seed}")
    vocab = a.vocab
    result: Dict[str, object] = {"label": label, "flags": " ".join(flags), "requests": []}
    with Server(model, flags, os.path.join(log_dir, f"{label}.log"), cpu=a.cpu,
                timeout=a.start_timeout) as server:
        url = server.url
        result["startup_s"] = server.startup_s
        prefill_once(url, [rng.randrange(vocab) for _ in range(64)], a.request_timeout)
        s = freetoken_stats(url)
        if s is not None:
            result["pool_bytes"] = s["pool"]["bytes"]
            result["cache"] = s["cache"]
            result["prefill_mode"] = s.get("prefill_mode")
        if a.working_set and label.startswith("ft-"):
            result["working_set"] = working_set(url, rng, a)
            print(json.dumps({"system": label, "working_set": {
                k: v["lru_fills"] for k, v in result["working_set"].items()
                if isinstance(v, dict)}}), flush=True)
        for kind, lengths in (("short", a.short), ("long", a.lengths)):
            for n in lengths:
                if a.warmup:
                    prefill_once(url, [rng.randrange(vocab) for _ in range(n)],
                                 a.request_timeout)
                ids = [rng.randrange(vocab) for _ in range(n)]
                before = freetoken_stats(url)
                secs = prefill_once(url, ids, a.request_timeout)
                rec = {"kind": kind, "tokens": n, "ttft_s": secs, "tok_s": n / secs,
                       "counters": _delta(before, freetoken_stats(url))}
                print(json.dumps({"system": label, **rec}), flush=True)
                result["requests"].append(rec)
        end = freetoken_stats(url)
        if end is not None:  # the CPU share's rule as calibrated by the run
            result["prefill_cpu_end"] = end.get("prefill_cpu")
            print(json.dumps({"system": label, "prefill_cpu_end": result["prefill_cpu_end"]}),
                  flush=True)
        if a.bench_serving and label in a.bench_serving.split(","):
            result["bench_serving"] = bench_serving(url, a, log_dir, label)
    m = None
    for line in open(os.path.join(log_dir, f"{label}.log"), errors="replace"):
        if "--chunked-prefill-size" in line and "FreeToken" in line:
            m = line.strip()
    result["chunk_log"] = m
    return result


def bench_serving(url: str, a, log_dir: str, label: str) -> Optional[dict]:
    """SGLang's own client (``python -m sglang.bench_serving``, ``random-ids``) on this
    server: ``--bench-serving-prompts`` prompts of ``--bench-serving-len`` tokens, one output
    token each, one at a time. Returns its JSON summary, or None if it failed."""
    out = os.path.join(log_dir, f"bench_serving-{label}.jsonl")
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", url, "--dataset-name", "random-ids", "--tokenize-prompt",
           "--tokenizer", a.tokenizer, "--random-input-len", str(a.bench_serving_len),
           "--random-output-len", "1", "--random-range-ratio", "1.0",
           "--num-prompts", str(a.bench_serving_prompts), "--max-concurrency", "1",
           "--output-file", out, "--seed", "7"]
    with open(os.path.join(log_dir, f"bench_serving-{label}.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
    if rc != 0 or not os.path.exists(out):
        return None
    lines = [json.loads(l) for l in open(out) if l.strip()]
    keep = ("mean_e2e_latency_ms", "median_e2e_latency_ms", "mean_ttft_ms", "input_throughput",
            "completed", "total_input_tokens", "duration")
    return {k: lines[-1].get(k) for k in keep} if lines else None


def ceiling_tok_s(tokens: int, chunk: int, pool_bytes: int, b_p: float) -> float:
    """Prefill tok/s if every chunk cost exactly one pass of the pool at B_P (GB/s)."""
    return tokens / (math.ceil(tokens / chunk) * pool_bytes / (b_p * 1e9))


def report(doc: dict, out_dir: str) -> str:
    """Markdown table (tok/s per system and length, ratio to the ceiling) and a PNG plot."""
    runs, b_p, chunk = doc["runs"], doc["b_p_gb_s"], doc["chunk"]
    pool = next((r["pool_bytes"] for r in runs if r.get("pool_bytes")), None)
    lines = [f"B_P {b_p:.1f} GB/s (pinned 2 GiB copy, measured here); FreeToken chunk "
             f"{chunk} tokens; pool {pool / 2**30:.2f} GiB" if pool and b_p else "", ""]
    for kind in ("long", "short"):
        lengths = sorted({q["tokens"] for r in runs for q in r["requests"] if q["kind"] == kind})
        if not lengths:
            continue
        head = "| system | " + " | ".join(str(n) for n in lengths) + " |"
        lines += [f"Prefill tok/s ({kind} prompts; TTFT in s in brackets)", "", head,
                  "|" + "---|" * (len(lengths) + 1)]
        for r in runs:
            by = {q["tokens"]: q for q in r["requests"] if q["kind"] == kind}
            cells = [f"{by[n]['tok_s']:.0f} ({by[n]['ttft_s']:.2f})" if n in by else "-"
                     for n in lengths]
            lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
        if pool and b_p and kind == "long":
            cells = [f"{ceiling_tok_s(n, chunk, pool, b_p):.0f}" for n in lengths]
            lines.append("| ceiling (chunks x pool / B_P) | " + " | ".join(cells) + " |")
            for r in runs:
                if not r["label"].startswith("ft-"):
                    continue
                by = {q["tokens"]: q for q in r["requests"] if q["kind"] == kind}
                cells = [f"{by[n]['tok_s'] / ceiling_tok_s(n, chunk, pool, b_p):.2f}"
                         if n in by else "-" for n in lengths]
                lines.append(f"| {r['label']} / ceiling | " + " | ".join(cells) + " |")
        lines.append("")
    ws = [r for r in runs if r.get("working_set")]
    if ws:
        lines += ["Decode after a long prefill: LRU fills per request (A: 128-token prompt, "
                  "32 new tokens; B: the long prompt, 1 new token)", "",
                  "| system | A (cold) | A again | B | A after B | B: LRU entries evicted / "
                  "seeded |", "|---|---:|---:|---:|---:|---|"]
        for r in ws:
            w = r["working_set"]
            st = (w["b"]["counters"] or {}).get("prefill_stream") or {}
            lines.append(
                f"| {r['label']} | {w['a1']['lru_fills']} | {w['a2']['lru_fills']} | "
                f"{w['b']['lru_fills']} ({w['b_tokens']} tokens) | {w['a3']['lru_fills']} | "
                f"{st.get('lru_evicted', '-')} / {st.get('lru_seeded', '-')} |")
        lines.append("")
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "prefill.md"), "w") as f:
        f.write(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in runs:
            q = sorted((q["tokens"], q["tok_s"]) for q in r["requests"] if q["kind"] == "long")
            if q:
                ax.plot(*zip(*q), marker="o", label=r["label"])
        if pool and b_p:
            lengths = sorted({q["tokens"] for r in runs for q in r["requests"]
                              if q["kind"] == "long"})
            ax.plot(lengths, [ceiling_tok_s(n, chunk, pool, b_p) for n in lengths], "k--",
                    label="ceiling: pool / B_P per chunk")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill tok/s")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "prefill.png"), dpi=120)
    except ImportError:
        pass
    return text


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="bench-prefill")
    ap.add_argument("--report", default=None, help="re-render a prefill.json and exit")
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--model-path", default=None, help="a real model instead of --shape")
    ap.add_argument("--tokenizer", default=None, help="tokenizer for bench_serving (default: "
                    "the tiny models' tokenizer, built in OUT)")
    ap.add_argument("--systems", default="stock,ft-stream,ft-stream1,ft-lru")
    ap.add_argument("--cache-ratio", type=float, default=0.25)
    ap.add_argument("--lengths", type=_ints, default=_ints("1024,2048,4096,8192,16384,32768"))
    ap.add_argument("--short", type=_ints, default=_ints("8,16,32,64,128,256,512"))
    ap.add_argument("--vocab", type=int, default=150000)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="no untimed request of each length before the timed one")
    ap.add_argument("--working-set", action="store_true",
                    help="also the A, A, B, A decode-after-prefill measurement (FT systems)")
    ap.add_argument("--working-set-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--common", default="--attention-backend triton --sampling-backend pytorch "
                    "--cuda-graph-max-bs 8 --disable-prefill-cuda-graph --skip-server-warmup "
                    "--max-total-tokens 70000 --context-length 40960")
    ap.add_argument("--cpu", action="store_true", help="CPU recipe (smoke runs on tiny models)")
    ap.add_argument("--bench-serving", default="ft-stream",
                    help="systems also measured with sglang.bench_serving ('' for none)")
    ap.add_argument("--bench-serving-len", type=int, default=8192)
    ap.add_argument("--bench-serving-prompts", type=int, default=3)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    a = ap.parse_args(argv)
    if a.report:
        doc = json.load(open(a.report))
        print(report(doc, os.path.dirname(os.path.abspath(a.report))))
        return 0
    names = [s for s in a.systems.split(",") if s]
    for s in names:  # ft-pcpu-V[-ISA]: --freetoken-prefill-cpu V [--freetoken-cpu-isa ISA]
        if s.startswith("ft-pcpu-"):
            value, _, isa = s[len("ft-pcpu-"):].partition("-")
            SYSTEMS[s] = FT + ["--freetoken-prefill-cpu", value] + (
                ["--freetoken-cpu-isa", isa] if isa else [])
    bad = [s for s in names if s not in SYSTEMS]
    if bad:
        raise SystemExit(f"--systems: unknown {bad}; choose from {sorted(SYSTEMS)}")
    os.makedirs(a.out_dir, exist_ok=True)
    stop_servers_on_sigterm()
    from freetoken_sglang.tiny_models import build_tiny_checkpoint

    if a.tokenizer is None:
        a.tokenizer = build_tiny_checkpoint("qwen3_moe", os.path.join(a.out_dir, "tokenizer"))
    if a.model_path:
        model, load = a.model_path, []
    else:
        model, load = write_shape(a.shape, a.out_dir), ["--load-format", "dummy"]
    b_p = measure_b_p()
    doc = {"b_p_gb_s": b_p, "date": time.strftime("%Y-%m-%d"), "runs": [], "chunk": None,
           "cache_ratio": a.cache_ratio, "common": a.common}
    for name in names:
        flags = load + ["--tokenizer-path", a.tokenizer] + a.common.split() + SYSTEMS[name]
        if name.startswith("ft-"):
            flags += ["--freetoken-cache-ratio", str(a.cache_ratio)]
        if a.cpu:  # the CPU recipe has no CUDA graph and no bench_serving run
            flags = [f for f in flags if f != "--disable-prefill-cuda-graph"]
            a.bench_serving = ""
        r = run_system(name, model, flags, a, a.out_dir)
        doc["runs"].append(r)
        if r.get("chunk_log") and doc["chunk"] is None:
            doc["chunk"] = int(r["chunk_log"].split("--chunked-prefill-size ")[1].split()[0])
        with open(os.path.join(a.out_dir, "prefill.json"), "w") as f:
            json.dump(doc, f, indent=1)
    if doc["chunk"] is None:
        doc["chunk"] = max(a.lengths)
    print(report(doc, a.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
