"""Resizing the GPU expert cache while serving (``POST /freetoken/cache``) under a batch-4 decode load: time per resize, decode tok/s before, during and after it, and GPU memory before and after (paper §2.3, §3.3).

    python benchmarks/bench_resize.py --shape qwen3-30b-a3b --sizes 0.10,0.25,0.10,0.25 \\
        --common "--attention-backend triton --sampling-backend pytorch --cuda-graph-max-bs 8" \\
        --out OUT.json
    python benchmarks/bench_resize.py --model-path TINY --cpu --sizes 0.5,0.25 --out OUT.json

One FreeToken server (``--freetoken-cache-ratio`` ``--start``); ``--batch`` client threads keep
streaming greedy requests (random prompt ids, ``--new-tokens`` each, EOS ignored) for the whole
run. After ``--window-s`` of load, each size in ``--sizes`` (fractions of the pool) is asked for
in turn, ``--window-s`` apart. Per resize: the server's answer (``ResizeReport``: seconds,
kept, dropped, graphs captured again), the client's round trip, decode tok/s of every stream
together in the window before, during the resize and in the window after, and ``nvidia-smi``'s
used and free memory before and after. After each shrink, free memory must have grown by at
least 90% of the bytes freed, and another process allocates all free GPU memory but
``--margin-gib`` (it must succeed: the freed memory went back to the device).
A greedy probe request (batch 1) before the load and after it must give the same tokens.

With ``--min-free-gib G`` the server also runs ``--freetoken-min-free-gb G`` (give no
``--sizes`` then): after the load window, another process takes ``--min-free-squeeze-gib`` of
GPU memory and holds it; the cache must shrink by itself, then grow back (to within one grow
step) once that process exits, each within ``--min-free-wait-s``, under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from typing import List

import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from servers import Server, stop_servers_on_sigterm, write_shape  # noqa: E402



def probe_ids(vocab: int) -> List[int]:
    return [10 + (i * 37) % (vocab - 20) for i in range(64)]


def vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 32000


def smi() -> dict:
    """GPU 0's used and free memory in MiB (empty without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.free",
                              "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout
        used, free = (int(x) for x in out.strip().splitlines()[0].split(","))
        return {"used_mib": used, "free_mib": free}
    except Exception:  # noqa: BLE001 - no GPU: no numbers
        return {}


def allocate_elsewhere(gib: float) -> dict:
    """Another process allocates ``gib`` GiB on GPU 0 and frees it; whether it could."""
    code = ("import torch,sys; x=torch.empty(int(float(sys.argv[1])*2**30), dtype=torch.uint8,"
            " device='cuda'); x.fill_(1); torch.cuda.synchronize(); print('ok')")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", code, str(gib)], capture_output=True, text=True,
                       timeout=120)
    return {"gib": round(gib, 2), "ok": p.returncode == 0 and "ok" in p.stdout,
            "seconds": round(time.time() - t0, 2), "error": p.stderr[-300:] if p.returncode else ""}


def hold_elsewhere(gib: float) -> subprocess.Popen:
    """Another process allocates ``gib`` GiB on GPU 0 and holds it until its stdin closes."""
    code = ("import torch,sys; x=torch.empty(int(float(sys.argv[1])*2**30), dtype=torch.uint8,"
            " device='cuda'); x.fill_(1); torch.cuda.synchronize(); print('held', flush=True);"
            " sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(gib)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "held":
        p.wait(timeout=60)
        raise SystemExit(f"another process could not take {gib:.2f} GiB of GPU memory "
                         f"(exit code {p.returncode})")
    return p


def wait_for_slots(url: str, done, wait_s: float) -> dict:
    """Polls ``/freetoken/stats`` every 0.5 s until ``done(cache)``; the cache part of the
    last document, with ``waited_s`` and ``ok``."""
    t0 = time.monotonic()
    while True:
        cache = requests.get(url + "/freetoken/stats", timeout=60).json()["cache"]
        ok = done(cache)
        if ok or time.monotonic() - t0 > wait_s:
            return {"ok": ok, "waited_s": round(time.monotonic() - t0, 2),
                    "slots": cache["slots"], "configured_slots": cache["configured_slots"],
                    "last_resize": cache.get("last_resize")}
        time.sleep(0.5)


def min_free_check(url: str, load, gib: float, squeeze_gib: float, wait_s: float) -> dict:
    """``--freetoken-min-free-gb``: another process takes ``squeeze_gib`` of the free memory
    (the watch has already brought free memory to G beyond SGLang's reserve), so the cache
    must shrink; the process exits, and the cache must grow back to within one grow step
    (``cache.resize.min_free_target``'s band; the step as ``FreeTokenRuntime.watch_free_memory``
    computes it) of where it was."""
    def stats():
        return requests.get(url + "/freetoken/stats", timeout=60).json()

    # the watch may already have resized at start (G beyond SGLang's reserve): wait until
    # the size holds still for 3 s
    t_settle, doc = time.monotonic(), stats()
    while time.monotonic() - t_settle < wait_s:
        time.sleep(3.0)
        last, doc = doc, stats()
        if doc["cache"]["slots"] == last["cache"]["slots"]:
            break
    start = doc["cache"]
    before = smi()
    if not before:
        raise SystemExit("--min-free-gib needs a CUDA GPU and nvidia-smi")
    row = {"min_free_gib": gib, "slots_before": start["slots"], "smi_before": before,
           "taken_gib": round(squeeze_gib, 2),
           "settled_s": round(time.monotonic() - t_settle, 2),
           "last_resize_before": start.get("last_resize")}
    t0 = time.monotonic()
    hog = hold_elsewhere(squeeze_gib)
    row["smi_held"] = smi()
    # the shrink the taken memory causes: at least half of it in slots (a drift of a slot or
    # two is not it)
    need = max(1, int(squeeze_gib * 2**30 / 2 / doc["pool"]["expert_bytes"]))
    row["shrink"] = wait_for_slots(url, lambda c: c["slots"] <= start["slots"] - need, wait_s)
    row["smi_after_shrink"] = smi()
    t1 = time.monotonic()
    hog.stdin.close()
    hog.wait(timeout=60)
    shrunk = row["shrink"]["slots"]
    step = max(doc["top_k"], start["configured_slots"] // 20)
    row["grow"] = wait_for_slots(
        url, lambda c: c["slots"] > shrunk and c["slots"] >= start["slots"] - step, wait_s)
    t2 = time.monotonic()
    row["smi_after_grow"] = smi()
    row["tok_s_held"] = load.rate(t0, t1)
    row["tok_s_released"] = load.rate(t1, t2)
    row["ok"] = row["shrink"]["ok"] and row["grow"]["ok"]
    return row


def greedy(url: str, ids: List[int], n: int) -> List[int]:
    r = requests.post(url + "/generate", json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                              "ignore_eos": True}}, timeout=600)
    r.raise_for_status()
    return r.json()["output_ids"]


class Load:
    """``batch`` threads streaming greedy requests until ``stop()``; ``events`` holds
    ``(time, tokens)`` per streamed chunk."""

    def __init__(self, url: str, batch: int, prompt_len: int, new_tokens: int, vocab: int):
        self.url, self.new_tokens = url, new_tokens
        self.prompt_len, self.vocab = prompt_len, vocab
        self.events: List[tuple] = []
        self.errors: List[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(batch)]
        for t in self.threads:
            t.start()

    def _run(self, i: int):
        rng = random.Random(i)
        while not self._stop.is_set():
            ids = [rng.randrange(10, self.vocab - 10) for _ in range(self.prompt_len)]
            try:
                r = requests.post(self.url + "/generate", json={
                    "input_ids": ids, "stream": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": self.new_tokens,
                                        "ignore_eos": True}}, stream=True, timeout=600)
                r.raise_for_status()
                seen = 0
                for line in r.iter_lines():
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    n = len(json.loads(line[5:])["output_ids"])
                    with self._lock:
                        self.events.append((time.monotonic(), n - seen))
                    seen = n
                if seen != self.new_tokens:
                    self.errors.append(f"thread {i}: {seen} of {self.new_tokens} tokens")
            except Exception as e:  # noqa: BLE001 - a failed request is a result
                self.errors.append(f"thread {i}: {type(e).__name__}: {e}")
                time.sleep(0.5)

    def rate(self, t0: float, t1: float) -> float:
        with self._lock:
            n = sum(k for t, k in self.events if t0 <= t < t1)
        return n / max(1e-9, t1 - t0)

    def stop(self):
        self._stop.set()
        for t in self.threads:
            t.join(timeout=600)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", help="a full-size shape with dummy weights (servers.SHAPES)")
    src.add_argument("--model-path")
    ap.add_argument("--layers", type=int, default=None,
                    help="with --shape: that many layers (a quicker start for functional runs)")
    ap.add_argument("--start", type=float, default=0.25, help="cache ratio at start")
    ap.add_argument("--sizes", default="0.10,0.25,0.10,0.25",
                    help="cache sizes to resize to in turn, as fractions of the pool")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--window-s", type=float, default=8.0)
    ap.add_argument("--margin-gib", type=float, default=2.0)
    ap.add_argument("--common", default="", help="flags for the server (space-separated)")
    ap.add_argument("--cpu", action="store_true", help="serve on the CPU (smoke runs)")
    ap.add_argument("--min-free-gib", type=float, default=None,
                    help="also serve with --freetoken-min-free-gb G and check it (CUDA)")
    ap.add_argument("--min-free-squeeze-gib", type=float, default=3.0)
    ap.add_argument("--min-free-wait-s", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.min_free_gib is not None and a.sizes:
        ap.error("--min-free-gib checks the watch alone: pass --sizes '' (requested resizes "
                 "change the size it grows back to)")
    if a.layers and not a.shape:
        ap.error("--layers goes with --shape")
    stop_servers_on_sigterm()
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    if a.shape:
        model = write_shape(a.shape, out_dir, a.layers)
        from servers import write_tokenizer

        tok = write_tokenizer(a.shape, os.path.join(out_dir, "tokenizer"))
        base = ["--load-format", "dummy", "--tokenizer-path", tok]
    else:
        model, base = a.model_path, []
    flags = base + ["--enable-freetoken", "--freetoken-cache-ratio", str(a.start)] + a.common.split()
    if a.min_free_gib is not None:
        flags += ["--freetoken-min-free-gb", str(a.min_free_gib)]
    result = {"flags": flags, "sizes": a.sizes, "batch": a.batch, "resizes": []}

    def save():
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    with Server(model, flags, os.path.join(out_dir, "bench_resize-server.log"), cpu=a.cpu) as srv:
        result["startup_s"] = srv.startup_s
        stats = requests.get(srv.url + "/freetoken/stats", timeout=60).json()
        rows = stats["pool"]["experts"]
        vocab = vocab_size(model)
        probe = probe_ids(vocab)
        result["probe_before"] = greedy(srv.url, probe, 32)
        load = Load(srv.url, a.batch, a.prompt_len, a.new_tokens, min(vocab, 150000))
        time.sleep(a.window_s)
        for frac in (float(x) for x in a.sizes.split(",") if x):
            slots = max(1, int(frac * rows))
            before = smi()
            t0 = time.monotonic()
            r = requests.post(srv.url + "/freetoken/cache", json={"slots": slots}, timeout=600)
            t1 = time.monotonic()
            after = smi()
            body = r.json()
            row = {"fraction": frac, "slots": slots, "status": r.status_code, "answer": body,
                   "round_trip_s": t1 - t0, "smi_before": before, "smi_after": after}
            if body.get("ok") and body["new_slots"] < body["old_slots"] and after:
                # the freed bytes went back to the device (not kept in torch's allocator) ...
                freed = (body["old_bytes"] - body["new_bytes"]) / 2**20
                row["free_gain_mib"] = after["free_mib"] - before["free_mib"]
                row["freed_returned"] = row["free_gain_mib"] >= 0.9 * freed
                # ... and another process can take them
                row["allocate_elsewhere"] = allocate_elsewhere(
                    after["free_mib"] / 1024 - a.margin_gib)
            time.sleep(a.window_s)
            row["tok_s_before"] = load.rate(t0 - a.window_s, t0)
            row["tok_s_during"] = load.rate(t0, t1)
            row["tok_s_after"] = load.rate(t1, t1 + a.window_s)
            result["resizes"].append(row)
            save()
            print(json.dumps({k: row[k] for k in ("fraction", "slots", "round_trip_s",
                                                    "tok_s_before", "tok_s_during",
                                                    "tok_s_after")}),
                  body.get("seconds"), body.get("kept"), body.get("graphs_recaptured"),
                  before, after, row.get("allocate_elsewhere"), flush=True)
        if a.min_free_gib is not None:
            result["min_free"] = row = min_free_check(
                srv.url, load, a.min_free_gib, a.min_free_squeeze_gib, a.min_free_wait_s)
            save()
            print("min-free:", json.dumps(row), flush=True)
        load.stop()
        result["load_errors"] = load.errors
        result["probe_after"] = greedy(srv.url, probe, 32)
        result["probe_equal"] = result["probe_after"] == result["probe_before"]
        result["final_stats"] = requests.get(srv.url + "/freetoken/stats", timeout=60).json()
    save()
    print("probe equal:", result["probe_equal"], "load errors:", len(result["load_errors"]))
    ok = result["probe_equal"] and not result["load_errors"] and all(
        r["status"] == 200 and r.get("allocate_elsewhere", {"ok": True})["ok"]
        and r.get("freed_returned", True)
        for r in result["resizes"]) and result.get("min_free", {"ok": True})["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
