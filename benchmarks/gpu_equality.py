"""GPU equality check: greedy tokens of a server with ``--enable-freetoken`` (25% cache, CUDA
graphs on) equal stock SGLang's, in BF16, on a tiny random checkpoint. Stock runs once, then
FreeToken with each of ``--miss-policies``: ``fill`` must be identical (exit status 1 if
not); with ``qstar`` / ``cpu`` the CPU executor's arithmetic (fp32 accumulation of BF16
weights) differs from the GPU kernels', so the report shows where the first token differs,
if anywhere, and the CPU-executed expert count proves the host-function path ran.

    python benchmarks/gpu_equality.py --family qwen3_moe --miss-policies fill,qstar,cpu \
        --bandwidth 55,90 --out results.json
    python benchmarks/gpu_equality.py --family deepseek_v3 --quant fp8_block  # FP8 experts
    python benchmarks/gpu_equality.py --family qwen3_moe --quant nvfp4
    python benchmarks/gpu_equality.py --family gpt_oss --quant mxfp4 \
        --common-args '{"moe_runner_backend": "triton"}'

With ``--quant nvfp4`` or ``mxfp4`` the policies run with ``--freetoken-fp4-kernels
dequantized`` (the FP4 slots dequantized per call for SGLang's Triton kernels,
``execute/slot_moe.py``: fill must be identical), and FreeToken also runs fill with the direct
FP4 kernels (the default; their fp32 sums run in another order: reported, as qstar's) and once
with ``--freetoken-backend cpu``. MXFP4's fill must equal stock's Triton runner (which dequantizes
the experts at load). Stock NVFP4 on Hopper runs Marlin's W4A16 kernel, so for NVFP4 stock
serves the checkpoint's BF16 twin (its experts dequantized, exact in BF16), which FreeToken's
fill on the NVFP4 checkpoint must equal.
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = [
    [5, 6, 7, 8],
    [100, 20, 3, 44, 51, 60, 7, 8, 9, 10, 11],
    list(range(30, 90)),
    [200 + (i * 7) % 150 for i in range(150)],
    [(i * 11) % 300 + 10 for i in range(700)],
]


def _best_two(top):
    """The two best logprobs of a position's top-logprob list (NaN where missing)."""
    vals = [float(t[0]) for t in (top or [])[:2]]
    return vals + [float("nan")] * (2 - len(vals))


def run(model_path, new_tokens, extra, freetoken=True):
    import sglang as sgl

    t0 = time.time()
    llm = sgl.Engine(
        model_path=model_path,
        dtype="bfloat16",
        attention_backend="triton",
        sampling_backend="pytorch",
        cuda_graph_max_bs_decode=8,
        mem_fraction_static=0.5,
        log_level="error",
        **extra,
    )
    start = time.time() - t0
    sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    seq, logprobs = [], []
    for p in PROMPTS:
        o = llm.generate(input_ids=p, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
        seq.append(o["output_ids"])
        # Per position: the chosen token's logprob and the two best logprobs.
        logprobs.append([
            [float(c[0])] + _best_two(top)
            for c, top in zip(o["meta_info"]["output_token_logprobs"],
                              o["meta_info"]["output_top_logprobs"])
        ])
    batch = [o["output_ids"] for o in llm.generate(input_ids=PROMPTS, sampling_params=sp)]
    stats = None
    if freetoken:
        doc = llm.get_server_info()["internal_states"][0]["freetoken"]
        stats = dict(doc["total"], prefill_stream=doc.get("prefill_stream"),
                     cache=doc.get("cache"), anchors=doc.get("anchors"))
    llm.shutdown()
    return {"start_s": start, "sequential": seq, "batched": batch, "stats": stats,
            "logprobs": logprobs}


def divergence(stock, ft):
    """Per prompt: the first differing token, stock's top-1 minus top-2 logprob there (nats;
    a near-tie when small), and the largest |logprob difference| (nats) of the chosen tokens
    before it."""
    out = []
    for s, f, ls, lf in zip(stock["sequential"], ft["sequential"], stock["logprobs"], ft["logprobs"]):
        j = next((i for i, (x, y) in enumerate(zip(s, f)) if x != y), None)
        upto = len(s) if j is None else j
        out.append({
            "first_diff": j,
            "stock_margin_at_diff": ls[j][1] - ls[j][2] if j is not None and j < len(ls) else None,
            "max_abs_logprob_diff_before": max(
                (abs(a[0] - b[0]) for a, b in zip(ls[:upto], lf[:upto])), default=0.0),
        })
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--workdir", default="/tmp/ft-gpu-eq")
    ap.add_argument("--miss-policies", default=None,
                    help="comma-separated, from fill, qstar, cpu")
    ap.add_argument("--bandwidth", default=None, help="B_P,B_H for qstar (else measured)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--num-layers", type=int, default=12,
                    help="12: a quarter of the pool holds two full-layer prefill buffers")
    ap.add_argument("--prefill-checks", nargs="?", const="lru,reserved,waves", default="",
                    help="also run fill with: lru (prefill through the LRU, "
                         "--freetoken-prefill lru), reserved (prefill buffers reserved, not "
                         "borrowed), waves (a cache smaller than two layers), anchors_off "
                         "(hybrid families: no semantic anchors), prefill_cpu (a CPU share "
                         "of 0.5 in streamed prefill); a comma list, lru,reserved,waves when "
                         "bare")
    ap.add_argument("--quant", default="none", choices=["none", "fp8_block", "nvfp4", "mxfp4"],
                    help="fp8_block: the routed experts quantized to FP8 with [128, 128] block "
                         "scales; nvfp4 (ModelOpt FP4), mxfp4 (--family gpt_oss): also one run "
                         "with --freetoken-backend cpu (freetoken_sglang/tiny_quant.py); stock "
                         "and FreeToken both serve that checkpoint")
    ap.add_argument("--common-args", default="{}",
                    help="JSON of extra sglang.Engine keywords for both stock and FreeToken, "
                         "e.g. '{\"moe_runner_backend\": \"triton\"}' (GPT-OSS)")
    ap.add_argument("--stock-args", default="{}",
                    help="JSON of extra sglang.Engine keywords for stock SGLang, e.g. "
                         "'{\"disable_shared_experts_fusion\": true}' (FreeToken sets it)")
    a = ap.parse_args()
    if a.quant in ("nvfp4", "mxfp4"):
        if (a.family == "gpt_oss") != (a.quant == "mxfp4"):
            ap.error("--quant mxfp4 is GPT-OSS's format (--family gpt_oss); --quant nvfp4 "
                     "quantizes the per-expert checkpoints of the other families")
    a.miss_policies = a.miss_policies or "fill"
    from freetoken_sglang.tiny_models import TinyShape, build_tiny_checkpoint

    path = build_tiny_checkpoint(
        a.family,
        f"{a.workdir}/{a.family}",
        TinyShape(hidden_size=256, head_dim=64, num_heads=4, num_kv_heads=2,
                  num_layers=a.num_layers, num_experts=16, top_k=4,
                  moe_intermediate_size=128,
                  kv_lora_rank=512 if a.family == "deepseek_v3" else 0),
        dtype="bfloat16",
    )
    if a.quant == "fp8_block":
        from freetoken_sglang.tiny_quant import write_fp8_block

        path, _ = write_fp8_block(path, path + "-fp8", path + "-fp8-twin", block=(128, 128))
    elif a.quant in ("nvfp4", "mxfp4"):
        from freetoken_sglang import tiny_quant

        write = tiny_quant.write_nvfp4 if a.quant == "nvfp4" else tiny_quant.write_mxfp4
        path, twin = write(path, f"{path}-{a.quant}", f"{path}-{a.quant}-twin")
    policies = [p for p in a.miss_policies.split(",") if p]
    for p in policies:
        if p not in ("fill", "qstar", "cpu"):
            raise SystemExit(f"--miss-policies: unknown policy {p!r} (choose from fill, qstar, cpu)")
    common = json.loads(a.common_args)
    # Stock NVFP4 on Hopper is Marlin's W4A16 kernel, not SGLang's Triton MoE: stock serves
    # the BF16 twin (the dequantized experts, exact) instead, which FreeToken must equal.
    stock_path = twin if a.quant == "nvfp4" else path
    stock = run(stock_path, a.new_tokens, {**common, **json.loads(a.stock_args)}, freetoken=False)
    results, full = [], {"stock": stock}
    # FP4: the required runs take SGLang's Triton MoE over dequantized slots (its results bit
    # for bit); the direct kernels (the default) sum in another fp32 order: reported
    fp4 = {"freetoken_fp4_kernels": "dequantized"} if a.quant in ("nvfp4", "mxfp4") else {}
    runs = [(p, dict(fp4)) for p in policies]
    if fp4:  # reported, not required (as qstar's and cpu's)
        runs.append(("fill", {"freetoken_fp4_kernels": "direct"}))
        runs.append(("backend-cpu", {"freetoken_backend": "cpu"}))
    checks = {"lru": {"freetoken_prefill": "lru"},
              "reserved": {"freetoken_prefill_buffers": "reserved"},
              "waves": {"freetoken_cache_slots": 12},
              # hybrid families: semantic anchors off (SGLang's own hybrid cache strategy)
              "anchors_off": {"freetoken_anchors": "off"},
              # half of each streamed layer's non-resident experts on the C executor (its
              # fp32 arithmetic: reported like qstar's, not required to be identical)
              "prefill_cpu": {"freetoken_prefill_cpu": "0.5"},
              # q* with the late fill (a lone miss on the CPU, filled after its call on a side
              # stream joined by the last MoE layer): reported like qstar's; a slot read
              # before its late fill landed would show as garbage tokens from the first miss.
              # Give --bandwidth with B_P/B_H under 1/2, e.g. 30,100, or no call fills late.
              "late_fill": {"freetoken_miss_policy": "qstar", "freetoken_late_fill": "on"},
              # ... of every CPU run (any --bandwidth)
              "late_fill_all": {"freetoken_miss_policy": "qstar", "freetoken_late_fill": "all"}}
    for name in [c for c in a.prefill_checks.split(",") if c]:
        if name not in checks:
            raise SystemExit(f"--prefill-checks: unknown {name!r} (choose from {', '.join(checks)})")
        runs.append(("fill", {**fp4, **checks[name]}))
    for policy, more in runs:
        ft_kwargs = {
            **common,
            "enable_freetoken": True,
            "freetoken_cache_ratio": 0.25,
            "freetoken_miss_policy": policy,
            **more,
        }
        if "freetoken_cache_slots" in more:
            del ft_kwargs["freetoken_cache_ratio"]
        if "freetoken_backend" in more:  # no cache, no miss policy
            del ft_kwargs["freetoken_cache_ratio"], ft_kwargs["freetoken_miss_policy"]
        policy = ft_kwargs.get("freetoken_miss_policy", policy)
        if a.bandwidth and policy == "qstar":
            ft_kwargs["freetoken_bandwidth"] = a.bandwidth
        ft = run(path, a.new_tokens, ft_kwargs)
        same = {k: stock[k] == ft[k] for k in ("sequential", "batched")}
        div = divergence(stock, ft)
        result = {
            "family": a.family,
            "quant": a.quant,
            "miss_policy": policy,
            "extra": more,
            "prompts": len(PROMPTS),
            "new_tokens": a.new_tokens,
            "identical": same,
            "first_differing_token_per_prompt": [d["first_diff"] for d in div],
            "divergence": div,
            "freetoken_stats": ft["stats"],
            "start_s": {"stock": stock["start_s"], "freetoken": ft["start_s"]},
        }
        print(json.dumps(result, indent=1), flush=True)
        results.append(result)
        full[policy + "".join(f",{k}={v}" for k, v in more.items())] = ft
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"results": results, "runs": full}, f)
    # Waves sum their partial outputs (fp32, then the layer dtype): reported, not required.
    bad = [r["miss_policy"] for r in results if r["miss_policy"] == "fill"
           and "freetoken_cache_slots" not in r["extra"]
           and "freetoken_prefill_cpu" not in r["extra"]
           and r["extra"].get("freetoken_fp4_kernels") != "direct"
           and not all(r["identical"].values())]
    if bad:
        raise SystemExit("FreeToken's greedy tokens differ from stock SGLang's (fill policy)")
    idle = [r["miss_policy"] for r in results
            if r["miss_policy"] != "fill" and not (r["freetoken_stats"] or {}).get("cpu")]
    if idle:
        raise SystemExit(f"miss policy {', '.join(idle)}: no expert ran on the CPU, so its CPU "
                         "path was not exercised (the cache may be too large for this check)")


if __name__ == "__main__":
    main()
