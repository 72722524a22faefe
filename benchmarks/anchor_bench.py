"""Re-prefilled tokens and TTFT per turn of edited agent sessions on a hybrid MoE: FreeToken's semantic anchors against stock SGLang's hybrid cache (paper §3.1).

    python benchmarks/anchor_bench.py --shape qwen3.6-35b-a3b --scale 0.1 --decode-cap 4 \\
        --systems stock,stock-no-buffer,ft-anchors,ft-anchors-off --out-dir OUT
    python benchmarks/anchor_bench.py --model-path TINY_HYBRID --cpu --scale 0.01 ...  # smoke

Sessions: W2 and W4 (``workloads.py``), each with each harness edit (``--edits``), one session
at a time, the radix cache flushed before each. Per request: ``reprefill`` (prompt tokens less
the cached tokens SGLang reports: the tokens actually prefilled), ``suffix`` (prompt tokens
less the longest common prefix with any earlier prompt of the session: the true new suffix,
the least any cache can re-prefill) and TTFT. An *edited* turn is one whose prompt does not
extend the previous prompt. Per system and session: Σreprefill / Σsuffix over the edited
turns, and the worst TTFT over the session against each stock system's worst on the same
session.

Systems: ``stock`` (stock SGLang's default: every expert on the GPU; for
``Qwen3_5MoeForConditionalGeneration`` on a GPU, ``auto`` resolves to ``extra_buffer``),
``stock-no-buffer`` (``--mamba-radix-cache-strategy no_buffer``), ``ft-anchors`` (FreeToken,
anchors on: the default, ``--freetoken-anchor-cuts auto``), ``ft-anchors-cuts`` (anchors that
end a chunk at each marker: ``--freetoken-anchor-cuts on``), ``ft-anchors-off`` (FreeToken
with no_buffer and no anchors) and ``ft-anchors-dN`` (cuts on, ``--freetoken-anchor-min-distance
N``). ``--system-sessions NAME=S+S`` runs fewer sessions on one system. Each server first
answers one short untimed request (JIT warm-up), then the cache is flushed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import serve_bench  # noqa: E402
import workloads as wl  # noqa: E402
from servers import Server, stop_servers_on_sigterm, write_shape  # noqa: E402

SESSIONS = ("W2:placeholder", "W2:drop_thinking", "W2:last_n", "W4:drop_thinking",
            "W4:placeholder", "W4:last_n")
STOCK = ("stock", "stock-no-buffer")
NO_BUFFER = ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]


def system_flags(name: str, cache_ratio: float) -> List[str]:
    """launch_server flags of a system (see the module docstring).

    Raises:
        SystemExit: an unknown system name.
    """
    ft = ["--enable-freetoken", "--freetoken-cache-ratio", str(cache_ratio)]
    if name == "stock":
        return []
    if name == "stock-no-buffer":
        return list(NO_BUFFER)
    if name == "ft-anchors":
        return ft
    if name == "ft-anchors-cuts":
        return ft + ["--freetoken-anchor-cuts", "on"]
    if name == "ft-anchors-off":
        return ft + ["--freetoken-anchors", "off"] + NO_BUFFER
    if name.startswith("ft-anchors-d") and name[len("ft-anchors-d"):].isdigit():
        return ft + ["--freetoken-anchor-cuts", "on",
                     "--freetoken-anchor-min-distance", name[len("ft-anchors-d"):]]
    raise SystemExit(f"unknown system {name!r}: choose from stock, stock-no-buffer, ft-anchors, "
                     "ft-anchors-cuts, ft-anchors-off, ft-anchors-dN")


def annotate(records: List[dict], reqs: List[wl.Request], tokenizer,
             min_distance: Optional[int] = None, cuts_on: bool = True) -> None:
    """Add ``suffix``, ``edited`` and ``reprefill`` to each request record (in place), and
    with ``min_distance`` (an anchors system) ``cuts``: the chunk ends the anchor plan makes
    beyond the cached prefix (``anchors.plan``, the default markers). A record whose server
    prompt length differs from the prompt rendered here gets ``prompt_mismatch`` (its suffix
    is then not the server's)."""
    from freetoken_sglang.anchors.markers import DEFAULT_MARKERS, find_markers, marker_ids
    from freetoken_sglang.anchors.plan import plan

    mids = marker_ids(tokenizer, DEFAULT_MARKERS)
    earlier: List[List[int]] = []
    for rec, r in zip(records, reqs):
        ids = wl.render_ids(tokenizer, r)
        lcp = max((wl.common_prefix(p, ids) for p in earlier), default=0)
        rec["suffix"] = len(ids) - lcp
        rec["edited"] = bool(earlier) and wl.common_prefix(earlier[-1], ids) < len(earlier[-1])
        rec["reprefill"] = rec.get("prefill_tokens")
        if rec.get("prompt_tokens") is not None and rec["prompt_tokens"] != len(ids):
            rec["prompt_mismatch"] = True
        if min_distance is not None and rec.get("cached_tokens") is not None:
            rec["cuts"] = len(plan(find_markers(ids, mids), rec["cached_tokens"], len(ids),
                                   min_distance, cuts_on).cuts)
        earlier.append(ids)


def anchor_distance(label: str) -> Optional[int]:
    """The anchors' minimum distance of a system (None: no anchors)."""
    if label in ("ft-anchors", "ft-anchors-cuts"):
        return 32  # config.py's default
    if label.startswith("ft-anchors-d"):
        return int(label[len("ft-anchors-d"):])
    return None


STEADY_FROM = 2  # turns before this one carry a fresh server's compile stalls


def summarize_session(records: List[dict]) -> dict:
    """Per session: requests, failed ones (``errors``: an error, or no cached-token count),
    prompts rendered differently here (``mismatched``), edited turns, Σreprefill / Σsuffix over
    edited turns and over all turns, the worst per-turn ratio, mean and worst TTFT (s), and
    the median and worst TTFT of the steady turns (from turn ``STEADY_FROM`` on)."""
    ok = [r for r in records if not r.get("error") and r.get("reprefill") is not None]
    ed = [r for r in ok if r["edited"]]

    def ratio(rs):
        s = sum(r["suffix"] for r in rs)
        return sum(r["reprefill"] for r in rs) / s if s else None

    ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    steady = [r["ttft_s"] for r in ok[STEADY_FROM:] if r.get("ttft_s") is not None]
    return {
        "requests": len(records), "errors": len(records) - len(ok), "edited": len(ed),
        "mismatched": sum(1 for r in records if r.get("prompt_mismatch")),
        "steady_median_ttft_s": statistics.median(steady) if steady else None,
        "steady_worst_ttft_s": max(steady) if steady else None,
        "reprefill": sum(r["reprefill"] for r in ok), "suffix": sum(r["suffix"] for r in ok),
        "edited_reprefill": sum(r["reprefill"] for r in ed),
        "edited_suffix": sum(r["suffix"] for r in ed),
        "edited_ratio": ratio(ed), "all_ratio": ratio(ok),
        "worst_turn_ratio": max((r["reprefill"] / r["suffix"] for r in ed if r["suffix"]),
                                default=None),
        "mean_ttft_s": serve_bench.mean_of(ttfts), "worst_ttft_s": max(ttfts) if ttfts else None,
        "cuts": sum(r["cuts"] for r in ok) if all("cuts" in r for r in ok) and ok else None,
    }


def run_sessions(url: str, label: str, sessions, scale: float, decode_cap: Optional[int],
                 tokenizer, on_session=None) -> Dict[str, dict]:
    """Run each ``W:edit`` session on a running server; per session its records, summary and
    (on FreeToken) the anchors counters' change. ``on_session(done)`` is called after each
    session with the sessions so far (to save them)."""
    client = serve_bench._client(url, 1800.0)
    model = serve_bench.served_model(url)
    warm = wl.Request("warmup", 0, 0, 0, "answer", [{"role": "user", "content": "Hello."}],
                      None, 2)
    serve_bench.stream_chat(client, warm.body(model))
    out = {}
    for sess in sessions:
        name, _, edit = sess.partition(":")
        reqs = wl.build(name, scale=scale).requests(edit, decode_cap=decode_cap)
        serve_bench.flush_cache(url)
        before = serve_bench.freetoken_stats(url)
        t0 = time.perf_counter()
        recs = serve_bench.run_session(client, model, reqs, None, True, label)
        wall = time.perf_counter() - t0
        after = serve_bench.freetoken_stats(url)
        cuts_on = ((after or {}).get("anchors") or {}).get("cuts", "on") in ("on", True)
        annotate(recs, reqs, tokenizer, anchor_distance(label), cuts_on)
        summ = summarize_session(recs)
        summ["wall_s"] = wall
        anchors = None
        if before is not None and after is not None and after.get("anchors"):
            a, b = after["anchors"], before.get("anchors") or {}
            anchors = {k: a[k] - b.get(k, 0) for k in
                       ("states_kept", "states_evicted", "restores", "requests",
                        "reprefill_tokens") if isinstance(a.get(k), int)}
            anchors["states_held"] = a.get("states_held")
        out[sess] = {"summary": summ, "anchors": anchors, "requests": recs}
        print(f"{label} {sess}: {json.dumps(summ)} anchors={json.dumps(anchors)}", flush=True)
        if on_session is not None:
            on_session(out)
    return out


def report(runs: List[dict]) -> str:
    """The markdown table: one row per system and session, with the steady turns' median and
    worst TTFT, and the worst TTFT over the whole session, over each stock system's on the same
    session."""
    stock = {}
    for r in runs:
        if r["label"] in STOCK:
            for s, v in r["sessions"].items():
                stock.setdefault(s, {})[r["label"]] = summarize_session(v["requests"])

    def f(x, nd=2):
        return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    def over(a, b):
        return f(a / b) if a and b else "–"

    cols = [c for c in STOCK if any(c in v for v in stock.values())]
    head = ["system", "session", "edited turns", "re-prefill / suffix, edited turns (tokens)",
            "worst turn ratio", "all turns ratio",
            "TTFT first / steady median / steady worst (s)"]
    # the TTFT target is on the worst turn of the whole session, first turns included
    head += [f"steady median, steady worst, session worst / {c}'s" for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---|---:|---:|---|" + "---|" * len(cols)]
    for r in runs:
        for s, v in r["sessions"].items():
            m = summarize_session(v["requests"])  # from the records: older runs.json too
            first = next((x.get("ttft_s") for x in v["requests"]), None)
            ratios = [f"{over(m['steady_median_ttft_s'], stock[s][c]['steady_median_ttft_s'])}, "
                      f"{over(m['steady_worst_ttft_s'], stock[s][c]['steady_worst_ttft_s'])}, "
                      f"{over(m['worst_ttft_s'], stock[s][c]['worst_ttft_s'])}"
                      if c in stock.get(s, {}) else "–" for c in cols]
            bad = f" ({m['mismatched']} prompts rendered differently)" if m.get("mismatched") else ""
            lines.append(
                f"| {r['label']} | {s} | {m['edited']}/{m['requests']}{bad} | "
                f"{f(m['edited_ratio'], 3)} ({m['edited_reprefill']} / {m['edited_suffix']}) | "
                f"{f(m['worst_turn_ratio'], 3)} | {f(m['all_ratio'], 3)} | "
                f"{f(first)} / {f(m['steady_median_ttft_s'])} / {f(m['steady_worst_ttft_s'])} |"
                + "".join(f" {x} |" for x in ratios))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", help="a full-size shape with dummy weights (servers.SHAPES)")
    src.add_argument("--model-path")
    ap.add_argument("--systems", default="stock,stock-no-buffer,ft-anchors,ft-anchors-off")
    ap.add_argument("--sessions", default=",".join(SESSIONS),
                    help="comma-separated WORKLOAD:EDIT (edits as in workloads.parse_edits)")
    ap.add_argument("--system-sessions", action="append", default=[], metavar="NAME=S+S",
                    help="the sessions of one system instead of --sessions (repeatable)")
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--decode-cap", type=int, default=4)
    ap.add_argument("--cache-ratio", type=float, default=0.25)
    ap.add_argument("--common", default="", help="flags for every server (space-separated)")
    ap.add_argument("--ft-common", default="",
                    help="flags for the FreeToken systems only (space-separated), e.g. "
                         "'--freetoken-prefill-cpu auto --freetoken-cpu-isa amx'")
    ap.add_argument("--cpu", action="store_true", help="serve on the CPU (smoke runs)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--append", action="append", default=[], metavar="RUNS_JSON",
                    help="runs.json of an earlier call: its runs come first (repeatable; with "
                    "--systems '' only the combined report is written)")
    a = ap.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    names = [n for n in a.systems.split(",") if n]
    flags_of = {n: system_flags(n, a.cache_ratio) + (a.ft_common.split() if n.startswith("ft-")
                                                     else []) for n in names}
    sessions = [s for s in a.sessions.split(",") if s]
    own = {}
    for item in a.system_sessions:
        n, eq, ss = item.partition("=")
        if not eq or n not in names or not ss:
            raise SystemExit(f"--system-sessions {item!r}: want NAME=S+S with NAME one of "
                             f"--systems ({', '.join(names)})")
        own[n] = [s for s in ss.split("+") if s]
    for s in sessions + [s for v in own.values() for s in v]:
        w, _, e = s.partition(":")
        if w not in wl.WORKLOADS:
            raise SystemExit(f"--sessions: unknown workload {w!r} in {s!r}")
        wl.parse_edits(e)
    runs = [r for p in a.append for r in json.load(open(p))["runs"]]

    def save(extra=()):
        done = runs + list(extra)
        with open(os.path.join(a.out_dir, "runs.json"), "w") as fh:
            json.dump({"runs": done, "scale": a.scale, "decode_cap": a.decode_cap,
                       "cache_ratio": a.cache_ratio, "sessions": sessions}, fh, indent=1)
        with open(os.path.join(a.out_dir, "report.md"), "w") as fh:
            fh.write(report([r for r in done if r["sessions"]]))

    if names:
        from transformers import AutoTokenizer

        if a.shape:
            from servers import write_tokenizer

            model = write_shape(a.shape, a.out_dir)
            tok_dir = write_tokenizer(a.shape, os.path.join(a.out_dir, "tokenizer"))
            base = ["--load-format", "dummy", "--tokenizer-path", tok_dir]
        else:
            model, tok_dir, base = a.model_path, a.model_path, []
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        base += ["--enable-cache-report", "--skip-server-warmup"] + a.common.split()
    for n in names:
        t0 = time.time()
        run = {"label": n, "flags": base + flags_of[n], "sessions": {}}

        def keep(done, run=run):  # sessions so far survive a failure or a cut call
            run["sessions"] = done
            save([run])

        try:
            with Server(model, run["flags"], os.path.join(a.out_dir, f"{n}.log"),
                        cpu=a.cpu) as srv:
                run.update(server=serve_bench.server_info(srv.url), startup_s=srv.startup_s)
                run["sessions"] = run_sessions(
                    srv.url, n, own.get(n, sessions), a.scale, a.decode_cap, tokenizer,
                    on_session=keep)
                run["wall_s"] = time.time() - t0
        except Exception as e:  # noqa: BLE001 - one failing system must not lose the others
            print(f"{n}: FAILED after {time.time() - t0:.0f} s: {type(e).__name__}: {e}",
                  flush=True)
            run["error"] = f"{type(e).__name__}: {e}"
        runs.append(run)
        save()
    save()
    print(report([r for r in runs if r["sessions"]]))
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    stop_servers_on_sigterm()
    sys.exit(main())
