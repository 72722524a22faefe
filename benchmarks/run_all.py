"""Serve one model with each system in turn under the same GPU memory budget, drive each with
the same agent workloads, and write one combined table, plots, a roofline and replay plots
of the recorded routing (paper §5).

Systems (``--systems``, comma-separated):

- ``stock-gpu``: stock SGLang, every expert on the GPU (the upper bound, where it fits);
- ``stock-offload``: stock SGLang with ``--cpu-offload-gb`` set to the expert pool minus
  FreeToken's cache, so that its GPU weight memory matches FreeToken's budget;
- ``ft-qstar``, ``ft-fill``, ``ft-cpu``: FreeToken with each miss policy, the cache at
  ``--cache-ratio`` of the pool, recording routing traces;
- ``ft-allhit``: FreeToken with every expert resident, for the roofline's all-hit step time.

    python benchmarks/run_all.py --shape qwen3-30b-a3b --cache-ratio 0.25 --scale 0.05 \\
        --systems stock-gpu,stock-offload,ft-qstar,ft-fill,ft-cpu --out-dir results/
    python benchmarks/run_all.py --model-path TINY --cpu --scale 0.01 --decode-cap 4 \\
        --systems stock-gpu,ft-qstar --out-dir /tmp/smoke        # CPU smoke run

Roofline (per FreeToken run and workload): the decode misses each token took (fills + CPU
misses of decode-sized layer calls, from ``/freetoken/stats``), served at the better of PCIe
fill and CPU execution balanced by q* (``S / max(B_P, B_H)`` per missed expert of S bytes),
plus the TPOT of an all-hit step; reported as achieved decode tok/s / the bound's tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import serve_bench  # noqa: E402
from servers import GpuMemorySampler, Server, write_shape  # noqa: E402

FT = ["--enable-freetoken"]


def expert_pool_gib(model_path: str) -> float:
    """The routed-expert pool size (GiB) of a model, from its config."""
    from transformers import AutoConfig

    from freetoken_sglang import families
    from freetoken_sglang.pool import GIB, bank_specs_for_layer

    import torch

    cfg = AutoConfig.from_pretrained(model_path)
    dtype = getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None) or "bfloat16"
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    specs = bank_specs_for_layer(cfg.hidden_size, families.expert_intermediate_size(cfg), dtype)
    n = len(families.moe_layer_ids(cfg)) * families.num_routed_experts(cfg)
    return n * sum(s.row_bytes for s in specs.values()) / GIB


def system_flags(name: str, args, pool_gib: float, trace_dir: str) -> List[str]:
    ratio = ["--freetoken-cache-ratio", str(args.cache_ratio)]
    record = ["--freetoken-record-routing", os.path.join(trace_dir, f"{name}.npz")]
    bw = ["--freetoken-bandwidth", args.bandwidth] if args.bandwidth else []
    if name == "stock-gpu":
        return []
    if name == "stock-offload":
        return ["--cpu-offload-gb", f"{pool_gib * (1 - args.cache_ratio):.2f}"]
    if name == "ft-allhit":
        return FT + ["--freetoken-cache-ratio", "1.0", "--freetoken-miss-policy", "fill"]
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
            allhit = base and base["workloads"].get(name, {}).get("summary", {}).get("mean_tpot_ms")
            if d and tokens > 0 and bw and allhit:
                misses_per_token = (d["fills"] + d["cpu"]) / tokens
                t = allhit / 1e3 + misses_per_token * expert_bytes / (max(bw["B_P"], bw["B_H"]) * 1e9)
                row.update(
                    misses_per_token=misses_per_token,
                    allhit_tpot_ms=allhit,
                    allhit_from=base["label"],
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
            f"{r['misses_per_token']:.1f} | {r['allhit_tpot_ms']:.2f} ({r['allhit_from']}) | "
            f"{r['bound_tok_s']:.2f} | {r['achieved_over_bound']:.3f} |"
        )
    return "\n".join(out)


def plot(runs: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(runs[0]["workloads"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        xs = [j + i * width for j in range(len(workloads))]
        summ = [r["workloads"][w]["summary"] for w in workloads]
        axes[0].bar(xs, [s["mean_decode_tok_s"] or 0 for s in summ], width, label=r["label"])
        axes[1].bar(xs, [s["mean_ttft_s"] or 0 for s in summ], width, label=r["label"])
        axes[2].bar(xs, [s["worst_ttft_s"] or 0 for s in summ], width, label=r["label"])
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


def replay_traces(trace_dir: str, out_dir: str) -> Optional[str]:
    """Replay every recorded trace through the cache policies (``replay.py``)."""
    traces = sorted(os.path.join(trace_dir, f) for f in os.listdir(trace_dir) if f.endswith(".npz"))
    if not traces:
        return None
    import subprocess

    subprocess.run(
        [sys.executable, os.path.join(HERE, "replay.py"), *traces[:1], "--out-dir", out_dir],
        check=True,
    )
    return out_dir


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", help="a full-size shape served with dummy weights (servers.SHAPES)")
    src.add_argument("--model-path")
    ap.add_argument("--systems", default="stock-gpu,stock-offload,ft-qstar,ft-fill,ft-cpu")
    ap.add_argument("--cache-ratio", type=float, default=0.25)
    ap.add_argument("--workloads", default="W1,W2,W4")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--decode-cap", type=int, default=None)
    ap.add_argument("--bandwidth", default=None, help="B_P,B_H for the FreeToken systems")
    ap.add_argument("--common", default="", help="flags for every server (space-separated)")
    ap.add_argument("--cpu", action="store_true", help="serve on the CPU (smoke runs)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--start-timeout", type=float, default=900)
    a = ap.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    trace_dir = os.path.join(a.out_dir, "traces")
    os.makedirs(trace_dir, exist_ok=True)
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
    sampler = GpuMemorySampler()
    runs = []
    try:
        for name in a.systems.split(","):
            flags = (["--enable-cache-report", "--skip-server-warmup"] + tokenizer_flags
                     + a.common.split() + system_flags(name, a, pool_gib, trace_dir))
            sampler.reset()
            t0 = time.time()
            with Server(model, flags, os.path.join(a.out_dir, f"{name}.log"), cpu=a.cpu,
                        timeout=a.start_timeout) as server:
                load_peak = sampler.peak_gib()
                sampler.reset()
                run = serve_bench.run_system(
                    server.url, workloads=a.workloads.split(","), scale=a.scale, label=name,
                    decode_cap=a.decode_cap,
                )
                run["system"] = {
                    "flags": flags,
                    "startup_s": server.startup_s,
                    "peak_gpu_gib_load": load_peak,
                    "peak_gpu_gib_serving": sampler.peak_gib(),
                    "weights_gb": server.weights_gb(),
                    "wall_s": time.time() - t0,
                }
            runs.append(run)
            print(f"{name}: done in {time.time() - t0:.0f} s", flush=True)
    finally:
        sampler.close()
    md = serve_bench.write_report(runs, os.path.join(a.out_dir, "runs.json"),
                                  os.path.join(a.out_dir, "runs.md"), per_request=False)
    roof = roofline(runs)
    roof_md = roofline_markdown(roof)
    systems_md = ["| system | start-up s | weights GB | peak GPU GiB load | peak GPU GiB serving |",
                  "|---|---|---|---|---|"]
    for r in runs:
        s = r["system"]
        systems_md.append(f"| {r['label']} | {s['startup_s']:.1f} | {s['weights_gb']} | "
                          f"{s['peak_gpu_gib_load']:.2f} | {s['peak_gpu_gib_serving']:.2f} |")
    report = "\n\n".join([md, "\n".join(systems_md), "Roofline:\n\n" + roof_md])
    with open(os.path.join(a.out_dir, "report.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(a.out_dir, "roofline.json"), "w") as f:
        json.dump(roof, f, indent=1)
    plot(runs, os.path.join(a.out_dir, "serving.png"))
    replay_traces(trace_dir, os.path.join(a.out_dir, "replay"))
    print(report)


if __name__ == "__main__":
    main()
