"""Serving benchmark client: runs the scripted agent workloads against a running SGLang server and reports TTFT, decode tok/s, prefill/cached tokens and FreeToken expert-cache counters.

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:30000 \\
        --workloads W1,W2,W4 --scale 1 --label freetoken --out-json r.json --out-md r.md
    python benchmarks/serve_bench.py --merge a.json b.json --out-md all.md

Requests go through ``/v1/chat/completions`` with ``stream: true`` and
``stream_options.include_usage``, one session at a time (agent workloads are single-user),
so the model's chat template renders them. Per request:

- TTFT (s): from sending the request to the first streamed chunk of the completion. SGLang
  sends it (``role: assistant``, with the first token's text) when the first token is
  generated; the text itself can come later when a token ends inside a UTF-8 character
  (the detokenizer holds it back), so the first chunk, not the first non-empty text, marks
  the first token. ``ttft_text_s`` records the first non-empty content / reasoning /
  tool-call delta too;
- decode tok/s: ``(n - 1) / (t_last - t_first)``, n the completion tokens SGLang reports,
  t_first / t_last the arrival of the first / last chunk of the completion (the last one
  carries the finish reason and comes with the last token); TPOT (ms) is its inverse;
- prompt tokens, cached tokens (``usage.prompt_tokens_details.cached_tokens``, which SGLang
  0.5.17 sends only with ``--enable-cache-report`` and only when non-zero: absent means 0 on
  a server with the flag; start servers with it, else cached and prefilled tokens are
  recorded as unknown) and the prefilled tokens ``prompt - cached`` (the re-prefill);
- completion tokens.

Per workload and per run: mean and worst TTFT, mean decode tok/s (the mean of per-request
rates, as in the paper's §5.1), token totals, and the difference of ``GET /freetoken/stats``
counters over it (absent on a stock server: 404).

With ``--budget-s`` (``run_system(budget_s=...)``) the run's wall-clock budget is shared
out in equal cumulative shares: workload i of n starts no request after ``(i+1)/n`` of the
budget has passed (time a workload leaves unused carries to the next), so that each workload
gets measured when the budget is short. Every summary
then holds ``planned`` (the requests scripted) and ``truncated``, and the table's requests
cell reads e.g. ``5/17 (budget)``.

A driver that starts and stops servers calls ``run_system`` once per system and
``write_report`` at the end (or this script once per system, then ``--merge``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import requests

try:
    from benchmarks import workloads as wl
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import workloads as wl  # type: ignore[no-redef]

STATS_ROUTE = "/freetoken/stats"
COUNTERS = ("reads", "hits", "fills", "evictions", "cpu")


# ---------------------------------------------------------------------------------------
# Server queries
# ---------------------------------------------------------------------------------------


def _get_json(url: str, timeout: float = 10.0):
    """(status code, JSON body or None); (None, None) when the server cannot be reached."""
    try:
        r = requests.get(url, timeout=timeout)
    except requests.RequestException:
        return None, None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


def served_model(base_url: str) -> str:
    """The first model id of ``GET /v1/models``.

    Raises:
        RuntimeError: the server did not answer with a model list.
    """
    code, body = _get_json(base_url.rstrip("/") + "/v1/models")
    if code != 200 or not body or not body.get("data"):
        raise RuntimeError(f"{base_url}/v1/models answered {code}: {body}")
    return body["data"][0]["id"]


def server_info(base_url: str) -> dict:
    """A few fields of SGLang's ``GET /get_server_info`` (empty if unavailable)."""
    code, body = _get_json(base_url.rstrip("/") + "/get_server_info")
    if code != 200 or not isinstance(body, dict):
        return {}
    keys = ("model_path", "context_length", "enable_cache_report", "disable_radix_cache",
            "page_size", "chunked_prefill_size", "max_running_requests", "attention_backend",
            "device", "dtype", "version")
    return {k: body[k] for k in keys if k in body}


def freetoken_stats(base_url: str) -> Optional[dict]:
    """``GET /freetoken/stats`` as JSON, or None when the server has no such route (a stock
    server answers 404) or cannot be reached."""
    code, body = _get_json(base_url.rstrip("/") + STATS_ROUTE)
    if code != 200 or not isinstance(body, dict) or "total" not in body:
        return None
    return body


def stats_delta(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Counter differences ``after - before`` (reads, hits, fills, evictions, cpu; in total,
    per phase (decode / prefill) and per layer) and the window's hit rate (hits / reads).
    None if either is missing."""
    if before is None or after is None:
        return None

    def diff(key):
        a, b = after.get(key) or {}, before.get(key) or {}
        d = {f: int(a.get(f, 0)) - int(b.get(f, 0)) for f in COUNTERS}
        d["hit_rate"] = d["hits"] / d["reads"] if d["reads"] else None
        return d

    total = diff("total")
    phases = {p: diff(p) for p in ("decode", "prefill") if p in after}
    prev = {l.get("layer_id"): l for l in before.get("layers", [])}
    layers = []
    for l in after.get("layers", []):
        p = prev.get(l.get("layer_id"), {})
        layers.append({"layer_id": l.get("layer_id"),
                       **{f: int(l.get(f, 0)) - int(p.get(f, 0)) for f in COUNTERS}})
    return {"total": total, **phases, "layers": layers}


def flush_cache(base_url: str) -> bool:
    """``POST /flush_cache`` (empties SGLang's radix prefix cache; FreeToken's expert cache
    is not touched). True if the server accepted it."""
    try:
        return requests.post(base_url.rstrip("/") + "/flush_cache", timeout=30).status_code == 200
    except requests.RequestException:
        return False


# ---------------------------------------------------------------------------------------
# One request
# ---------------------------------------------------------------------------------------


def _delta_has_output(delta) -> bool:
    if delta is None:
        return False
    if getattr(delta, "content", None) or getattr(delta, "tool_calls", None):
        return True
    extra = getattr(delta, "model_extra", None) or {}
    return bool(getattr(delta, "reasoning_content", None) or extra.get("reasoning_content"))


def stream_chat(client, body: dict, max_s: Optional[float] = None) -> dict:
    """Send one streaming chat completion with the ``openai`` client and time it. With
    ``max_s`` (s) the request is cut once it has run that long (also while waiting for a
    chunk): the stream is closed and ``error`` says so.

    Returns a dict: ``ttft_s`` (s, to the first chunk), ``ttft_text_s`` (s, to the first
    non-empty text), ``decode_s`` (s, first to last chunk),
    ``decode_tok_s`` (tokens/s), ``tpot_ms`` (ms/token), ``e2e_s`` (s), ``prompt_tokens``,
    ``cached_tokens`` (from ``prompt_tokens_details``; 0 when absent), ``completion_tokens``,
    ``output_chunks``, ``finish_reason``, ``error`` (None or the message)."""
    extra = {k: v for k, v in body.items()
             if k not in ("model", "messages", "tools", "max_tokens", "temperature", "stream",
                          "stream_options")}
    kwargs = dict(model=body["model"], messages=body["messages"], max_tokens=body["max_tokens"],
                  temperature=body.get("temperature", 0.0), stream=True,
                  stream_options={"include_usage": True}, extra_body=extra)
    if body.get("tools"):
        kwargs["tools"] = body["tools"]
    if max_s is not None:
        kwargs["timeout"] = max_s  # the longest wait for the first or the next chunk
    rec = {"ttft_s": None, "ttft_text_s": None, "decode_s": None, "decode_tok_s": None, "tpot_ms": None,
           "e2e_s": None, "prompt_tokens": None, "cached_tokens": None,
           "completion_tokens": None, "output_chunks": 0, "finish_reason": None, "error": None}
    t0 = time.perf_counter()
    t_first = t_last = t_text = None
    usage = None
    stream = None
    try:
        stream = client.chat.completions.create(**kwargs)
        for chunk in stream:
            now = time.perf_counter()
            if max_s is not None and now - t0 > max_s:
                rec["error"] = f"cut by the budget after {now - t0:.1f} s"
                break
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices or []:
                if t_first is None:
                    t_first = now
                t_last = now
                if _delta_has_output(ch.delta):
                    rec["output_chunks"] += 1
                    if t_text is None:
                        t_text = now
                if ch.finish_reason:
                    rec["finish_reason"] = ch.finish_reason
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if stream is not None and hasattr(stream, "close"):
            stream.close()  # a cut request is aborted by SGLang when its stream closes
    t_end = time.perf_counter()
    rec["e2e_s"] = t_end - t0
    if t_first is not None:
        rec["ttft_s"] = t_first - t0
    if t_text is not None:
        rec["ttft_text_s"] = t_text - t0
    if usage is not None:
        rec["prompt_tokens"] = usage.prompt_tokens
        rec["completion_tokens"] = usage.completion_tokens
        details = usage.prompt_tokens_details
        rec["cached_tokens"] = int(getattr(details, "cached_tokens", 0) or 0) if details else 0
    n = rec["completion_tokens"] if rec["completion_tokens"] is not None else rec["output_chunks"]
    if t_first is not None and t_last is not None and n and n > 1 and t_last > t_first:
        rec["decode_s"] = t_last - t_first
        rec["decode_tok_s"] = (n - 1) / rec["decode_s"]
        rec["tpot_ms"] = 1000.0 / rec["decode_tok_s"]
    return rec


# ---------------------------------------------------------------------------------------
# Sessions and runs
# ---------------------------------------------------------------------------------------


def _client(base_url: str, timeout: float):
    from openai import OpenAI

    return OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="EMPTY", max_retries=0,
                  timeout=timeout)


def run_session(client, model: str, requests_: Sequence[wl.Request], tokenizer=None,
                cache_report: Optional[bool] = True, label: str = "",
                deadline: Optional[float] = None,
                request_deadline: Optional[float] = None) -> List[dict]:
    """Run a session's requests in order; one record per request. With ``tokenizer``, each
    record also holds ``local_prompt_tokens`` (the prompt rendered here) and
    ``shared_prefix_tokens`` (tokens shared with the previous request's prompt: what an
    exact prefix cache could reuse). With ``deadline`` (a ``time.perf_counter()`` value) no
    request starts after it: fewer records than requests then. With ``request_deadline``
    (same clock) a request still running then is cut (its record's ``error`` says so)."""
    records, prev_ids = [], None
    for r in requests_:
        if deadline is not None and time.perf_counter() > deadline:
            break
        rec = {"system": label, "workload": r.workload, "index": r.index,
               "user_turn": r.user_turn, "step": r.step, "kind": r.kind,
               "edits": list(r.edits), "max_tokens": r.max_tokens,
               "messages": len(r.messages)}
        if tokenizer is not None:
            ids = wl.render_ids(tokenizer, r)
            rec["local_prompt_tokens"] = len(ids)
            rec["shared_prefix_tokens"] = wl.common_prefix(prev_ids, ids) if prev_ids else 0
            prev_ids = ids
        max_s = (None if request_deadline is None
                 else max(1.0, request_deadline - time.perf_counter()))
        rec.update(stream_chat(client, r.body(model), max_s) if max_s is not None
                   else stream_chat(client, r.body(model)))
        if cache_report is False:
            rec["cached_tokens"] = None  # the server does not report it
        if rec["prompt_tokens"] is not None and rec["cached_tokens"] is not None:
            rec["prefill_tokens"] = rec["prompt_tokens"] - rec["cached_tokens"]
        else:
            rec["prefill_tokens"] = None
        records.append(rec)
    return records


def mean_of(xs) -> Optional[float]:
    """The mean of the values that are not None (None when there is none)."""
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _sum(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) if xs else None


def summarize(records: Sequence[dict]) -> dict:
    """Aggregate request records: ``requests``, ``errors``, ``mean_ttft_s`` / ``worst_ttft_s``
    (s), ``mean_decode_tok_s`` (mean of per-request tok/s), ``mean_tpot_ms`` (ms), token
    totals (``prompt_tokens``, ``cached_tokens``, ``prefill_tokens``, ``completion_tokens``)
    and ``cached_fraction`` (cached / prompt tokens)."""
    ok = [r for r in records if not r.get("error")]
    ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    out = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "mean_ttft_s": mean_of(ttfts),
        "worst_ttft_s": max(ttfts) if ttfts else None,
        "mean_decode_tok_s": mean_of(r.get("decode_tok_s") for r in ok),
        "mean_tpot_ms": mean_of(r.get("tpot_ms") for r in ok),
    }
    for k in ("prompt_tokens", "cached_tokens", "prefill_tokens", "completion_tokens"):
        out[k] = _sum(r.get(k) for r in ok)
    out["cached_fraction"] = (out["cached_tokens"] / out["prompt_tokens"]
                              if out["prompt_tokens"] and out["cached_tokens"] is not None else None)
    return out


def run_system(
    base_url: str,
    model: Optional[str] = None,
    workloads: Sequence[str] = wl.WORKLOADS,
    scale: float = 1.0,
    label: str = "",
    edits: Optional[Dict[str, str]] = None,
    decode_cap: Optional[int] = None,
    seed: int = 0,
    tokenizer=None,
    flush: bool = True,
    timeout: float = 1800.0,
    budget_s: Optional[float] = None,
) -> dict:
    """Run ``workloads`` (in order, each a sequential session) against the server at
    ``base_url`` and return the run: ``label``, ``server``, per workload its ``summary``,
    ``edits`` and ``freetoken`` counter delta, the run's ``summary`` and ``freetoken``
    (``before`` / ``after`` / ``delta``; None on a stock server), and ``requests`` (one
    record per request).

    Args:
        edits: per workload an edit spec (``workloads.parse_edits``) replacing its default.
        decode_cap: cap on every request's decode tokens.
        tokenizer: a ``transformers`` tokenizer (or a path to load one) to also render each
            prompt locally.
        flush: empty SGLang's prefix cache before each workload (sessions then start cold
            whatever ran before).
        timeout: per request, s.
        budget_s: wall-clock budget (s) of the whole run, shared out in equal cumulative
            shares: workload i of n starts no request once ``(i+1)/n`` of it has passed, and
            a request still running one share after the budget's end is cut (shown as a
            failed request), so a run lasts at most ``budget_s * (1 + 1/n)`` plus start-up
            of the stream. Each workload's summary and the run's
            hold ``planned`` (requests scripted) and ``truncated`` (fewer were run); a
            workload never started has 0 requests.
    """
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    model = model or served_model(base_url)
    info = server_info(base_url)
    cache_report = info.get("enable_cache_report")
    client = _client(base_url, timeout)
    run = {"label": label, "base_url": base_url, "model": model, "scale": scale, "seed": seed,
           "decode_cap": decode_cap, "budget_s": budget_s, "server": info,
           "started": time.time(), "workloads": {}, "requests": []}
    ft_start = freetoken_stats(base_url)
    t_run = time.perf_counter()
    for i, name in enumerate(workloads):
        deadline = t_run + budget_s * (i + 1) / len(workloads) if budget_s is not None else None
        w = wl.build(name, scale=scale, seed=seed)
        reqs = w.requests((edits or {}).get(name), decode_cap=decode_cap)
        expired = deadline is not None and time.perf_counter() > deadline
        if flush and not expired:
            flush_cache(base_url)
        before = freetoken_stats(base_url)
        t0 = time.perf_counter()
        hard = (t_run + budget_s * (1 + 1 / len(workloads)) if budget_s is not None else None)
        recs = run_session(client, model, reqs, tokenizer, cache_report, label, deadline, hard)
        wall = time.perf_counter() - t0
        after = freetoken_stats(base_url)
        summ = summarize(recs)
        summ["wall_s"] = wall
        summ["planned"] = len(reqs)
        summ["truncated"] = len(recs) < len(reqs)
        run["workloads"][name] = {
            "title": w.title,
            "edits": list(reqs[0].edits) if reqs else [],
            "summary": summ,
            "freetoken": stats_delta(before, after),
        }
        run["requests"].extend(recs)
    ft_end = freetoken_stats(base_url)
    run["summary"] = summarize(run["requests"])
    run["summary"]["wall_s"] = time.perf_counter() - t_run
    ws = [w["summary"] for w in run["workloads"].values()]
    run["summary"]["planned"] = sum(s["planned"] for s in ws)
    run["summary"]["truncated"] = any(s["truncated"] for s in ws)
    run["freetoken"] = (None if ft_start is None and ft_end is None else
                        {"before": ft_start, "after": ft_end, "delta": stats_delta(ft_start, ft_end)})
    return run


# ---------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------


def _f(x, nd=2):
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def cell_text(text: str, n: int = 300) -> str:
    """One markdown table cell: one line, no pipes, at most ``n`` characters."""
    t = " ".join(str(text).split()).replace("|", "\\|")
    return t if len(t) <= n else t[: n - 1] + "…"


def _requests_cell(s: dict) -> str:
    """``17``, or ``5/17 (budget)`` when the budget cut the run short; failures appended."""
    out = str(s["requests"])
    if s.get("truncated"):
        out += f"/{s.get('planned', '?')} (budget)"
    if s.get("errors"):
        out += f" ({s['errors']} failed)"
    return out


def markdown(runs: Sequence[dict], per_request: bool = True) -> str:
    """Markdown tables: one row per system and workload (plus the run), then, with
    ``per_request``, one row per request (where the re-prefilled tokens show). A workload
    cut short by the budget shows ``run/planned (budget)`` in its requests cell."""
    lines = [
        "| system | workload | edits | requests | mean TTFT (s) | worst TTFT (s) | decode tok/s "
        "| TPOT (ms) | prompt tok | cached tok | prefilled tok | FT reads | FT hit rate |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        rows = [(n, w["edits"], w["summary"], w.get("freetoken")) for n, w in run["workloads"].items()]
        ft = (run.get("freetoken") or {}).get("delta")
        rows.append(("all", [], run["summary"], ft))
        for name, eds, s, ftd in rows:
            t = (ftd or {}).get("total") or {}
            lines.append(
                f"| {run['label'] or run['base_url']} | {name} | {'+'.join(eds) or '–'} "
                f"| {_requests_cell(s)} "
                f"| {_f(s['mean_ttft_s'], 3)} | {_f(s['worst_ttft_s'], 3)} "
                f"| {_f(s['mean_decode_tok_s'], 1)} | {_f(s['mean_tpot_ms'], 1)} "
                f"| {_f(s['prompt_tokens'])} | {_f(s['cached_tokens'])} | {_f(s['prefill_tokens'])} "
                f"| {_f(t.get('reads'))} | {_f(t.get('hit_rate'), 3)} |")
    if per_request:
        lines += ["", "| system | workload | # | turn.step | kind | prompt tok | cached tok "
                  "| prefilled tok | completion tok | TTFT (s) | decode tok/s | error |",
                  "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for run in runs:
            for r in run["requests"]:
                lines.append(
                    f"| {run['label'] or run['base_url']} | {r['workload']} | {r['index']} "
                    f"| {r['user_turn']}.{r['step']} | {r['kind']} | {_f(r['prompt_tokens'])} "
                    f"| {_f(r['cached_tokens'])} | {_f(r['prefill_tokens'])} "
                    f"| {_f(r['completion_tokens'])} | {_f(r['ttft_s'], 3)} "
                    f"| {_f(r['decode_tok_s'], 1)} | {(r['error'] or '')[:60]} |")
    return "\n".join(lines) + "\n"


def load_runs(paths: Sequence[str]) -> List[dict]:
    """Runs from JSON files written by this script (a single run or ``{"runs": [...]}``)."""
    runs = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        runs.extend(d["runs"] if "runs" in d else [d])
    return runs


def write_report(runs: Sequence[dict], out_json: Optional[str] = None,
                 out_md: Optional[str] = None, per_request: bool = True) -> str:
    """Write the runs as JSON (one run as is, several as ``{"runs": [...]}``) and as markdown;
    returns the markdown."""
    md = markdown(runs, per_request)
    if out_json:
        with open(out_json, "w") as f:
            json.dump(runs[0] if len(runs) == 1 else {"runs": list(runs)}, f, indent=1)
    if out_md:
        with open(out_md, "w") as f:
            f.write(md)
    return md


def _parse_edit_args(items: Sequence[str]) -> Dict[str, str]:
    out = {}
    for it in items or []:
        name, sep, spec = it.partition("=")
        if not sep or name not in wl.WORKLOADS:
            raise SystemExit(f"--edit wants WORKLOAD=SPEC (e.g. W2=last_n:5), not {it!r}")
        wl.parse_edits(spec)
        out[name] = spec
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--workloads", default=",".join(wl.WORKLOADS))
    p.add_argument("--scale", type=float, default=1.0, help="size multiplier (0.01 fits tiny 4k-context models)")
    p.add_argument("--label", default="", help="system name in the report")
    p.add_argument("--edit", action="append", default=[], metavar="W=SPEC",
                   help="context edits of a workload, replacing its default, e.g. "
                        "W2=last_n:5, W2=placeholder:3+drop_thinking, W4=none")
    p.add_argument("--decode-cap", type=int, default=None, help="cap on decode tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer path: also render prompts locally")
    p.add_argument("--no-flush", action="store_true", help="keep the prefix cache between workloads")
    p.add_argument("--timeout", type=float, default=1800.0, help="per request, s")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of the whole run, s, shared out between the "
                        "workloads: workload i of n starts no request after (i+1)/n of it; "
                        "the table shows the cut, e.g. 5/17 (budget)")
    p.add_argument("--out-json", default=None)
    p.add_argument("--out-md", default=None)
    p.add_argument("--no-per-request", action="store_true", help="markdown: summary table only")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no run: merge earlier runs' JSON files into one report")
    a = p.parse_args(argv)
    if a.merge:
        runs = load_runs(a.merge)
    else:
        names = [n.strip() for n in a.workloads.split(",") if n.strip()]
        for n in names:
            if n not in wl.WORKLOADS:
                raise SystemExit(f"unknown workload {n!r}; choose from {', '.join(wl.WORKLOADS)}")
        runs = [run_system(a.base_url, a.model, names, a.scale, a.label,
                           _parse_edit_args(a.edit), a.decode_cap, a.seed, a.tokenizer,
                           not a.no_flush, a.timeout, a.budget_s)]
    md = write_report(runs, a.out_json, a.out_md, not a.no_per_request)
    sys.stdout.write(md)
    return 1 if any(r["summary"]["errors"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
