"""Decode benchmark on a full-size MoE shape with dummy weights: stock SGLang (every expert on
the GPU) against FreeToken configurations, side by side in one run.

Each system is a real ``python -m sglang.launch_server`` (``--load-format dummy``); the
script measures start-up time, peak GPU memory (nvidia-smi, sampled) during load and while
serving, and decode tok/s at batch 1 and 4 from streamed ``/generate`` requests, then prints
a table with ratios against the first system.

    python benchmarks/bench_decode.py --shape qwen3-30b-a3b \\
        --system stock: --system ft25:--enable-freetoken,--freetoken-cache-ratio,0.25
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import requests

SHAPES = {
    # Qwen3-30B-A3B (config of Qwen/Qwen3-30B-A3B): 48 layers, 128 experts, top-8.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
    },
}


def write_shape(name: str, root: str) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SHAPES[name], f, indent=1)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GpuMemorySampler:
    """Samples ``nvidia-smi`` memory.used (MiB) of GPU 0 in a thread; ``peak()`` since the
    last ``reset()``."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self._peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                    capture_output=True, text=True, timeout=5,
                ).stdout.strip()
                self._peak = max(self._peak, int(out.splitlines()[0]))
            except Exception:
                pass
            self._stop.wait(self.interval)

    def reset(self):
        self._peak = 0

    def peak_gib(self) -> float:
        return self._peak / 1024

    def close(self):
        self._stop.set()
        self._t.join(timeout=5)


def stream_generate(url: str, input_ids: List[int], new_tokens: int) -> Dict[str, float]:
    """One streamed request; returns TTFT (s), decode tok/s over the tokens after the first,
    and the token count."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    with requests.post(
        url + "/generate",
        json={
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
            "stream": True,
        },
        stream=True,
        timeout=1800,
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
            count = msg.get("meta_info", {}).get("completion_tokens", n)
            if count > n:
                if first is None:
                    first = now
                last = now
                n = count
    decode = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
    return {"ttft_s": first - t0, "decode_tok_s": decode, "tokens": n}


def run_system(label, model_path, flags, args, sampler, log_dir) -> Dict[str, object]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
        "--load-format", "dummy", "--skip-tokenizer-init", "--port", str(port),
        "--attention-backend", "triton", "--sampling-backend", "pytorch",
        "--cuda-graph-max-bs", str(args.max_bs), "--max-running-requests", str(args.max_bs),
        "--context-length", str(args.context_length), "--skip-server-warmup",
        *args.common.split(), *flags,
    ]
    log_path = os.path.join(log_dir, f"{label}.log")
    log = open(log_path, "w")
    sampler.reset()
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    result: Dict[str, object] = {"label": label, "flags": " ".join(flags), "log": log_path}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{label} exited: " + open(log_path).read()[-3000:])
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() - t0 > args.start_timeout:
                raise RuntimeError(f"{label} not healthy after {args.start_timeout} s")
            time.sleep(0.5)
        result["startup_s"] = time.time() - t0
        result["peak_gpu_gib_load"] = sampler.peak_gib()
        rng = random.Random(0)
        prompt = lambda: [rng.randrange(1000, 100000) for _ in range(args.input_len)]
        stream_generate(url, prompt(), 16)  # warm-up (first request; its misses fill the cache)
        sampler.reset()
        b1 = [stream_generate(url, prompt(), args.new_tokens) for _ in range(args.repeats)]
        result["bs1_decode_tok_s"] = sum(r["decode_tok_s"] for r in b1) / len(b1)
        result["bs1_ttft_s"] = sum(r["ttft_s"] for r in b1) / len(b1)
        with ThreadPoolExecutor(4) as ex:
            t_b = time.perf_counter()
            b4 = list(ex.map(lambda _: stream_generate(url, prompt(), args.new_tokens), range(4)))
            wall = time.perf_counter() - t_b
        result["bs4_decode_tok_s_per_req"] = sum(r["decode_tok_s"] for r in b4) / 4
        result["bs4_total_tok_s"] = sum(r["tokens"] for r in b4) / wall
        result["peak_gpu_gib_serving"] = sampler.peak_gib()
        try:
            stats = requests.get(url + "/freetoken/stats", timeout=30)
            if stats.status_code == 200:
                s = stats.json()
                result["freetoken"] = {
                    "total": s["total"],
                    "cache_slots": s["cache"]["slots"],
                    "pool_experts": s["pool"]["experts"],
                    "load": s["load"],
                }
        except requests.RequestException:
            pass
        text = open(log_path).read()
        m = re.search(r"Peak GPU memory during load: ([0-9.]+) GiB", text)
        if m:
            result["torch_peak_gib_during_load"] = float(m.group(1))
        m = re.search(r"Load weight end\..*?mem usage=([0-9.]+) GB", text)
        if m:
            result["sglang_weight_gb"] = float(m.group(1))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return result


def table(results: List[Dict[str, object]]) -> str:
    base = results[0]
    cols = [
        ("bs1_decode_tok_s", "decode tok/s bs1"),
        ("bs4_total_tok_s", "decode tok/s bs4 (total)"),
        ("startup_s", "start-up s"),
        ("peak_gpu_gib_load", "peak GPU GiB load"),
        ("peak_gpu_gib_serving", "peak GPU GiB serving"),
        ("sglang_weight_gb", "weights GB (SGLang)"),
    ]
    lines = ["| system | " + " | ".join(c[1] for c in cols) + " | bs1 ratio vs " + base["label"] + " | hit rate |"]
    lines.append("|" + "---|" * (len(cols) + 3))
    for r in results:
        cells = [f"{r.get(k, float('nan')):.2f}" for k, _ in cols]
        ratio = r.get("bs1_decode_tok_s", float("nan")) / base.get("bs1_decode_tok_s", float("nan"))
        hit = r.get("freetoken", {}).get("total", {}).get("hit_rate")
        lines.append(
            f"| {r['label']} | " + " | ".join(cells) + f" | {ratio:.3f} | "
            + (f"{hit:.3f}" if hit is not None else "-") + " |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument(
        "--system", action="append", required=True,
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
    ap.add_argument("--out-dir", default=tempfile.mkdtemp(prefix="ft-bench-"))
    a = ap.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    model = write_shape(a.shape, a.out_dir)
    sampler = GpuMemorySampler()
    results = []
    try:
        for spec in a.system:
            label, _, flags = spec.partition(":")
            r = run_system(label, model, [f for f in flags.split(",") if f], a, sampler, a.out_dir)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        sampler.close()
    print(table(results))
    with open(os.path.join(a.out_dir, "bench_decode.json"), "w") as f:
        json.dump({"shape": a.shape, "args": vars(a), "results": results}, f, indent=1)
    with open(os.path.join(a.out_dir, "bench_decode.md"), "w") as f:
        f.write(table(results) + "\n")


if __name__ == "__main__":
    main()
