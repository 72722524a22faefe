"""Per-call cost of a decode-sized FP4 MoE layer call over slots: the direct kernels
(``kernels/fp4_moe.py``) against the dequantized path (``slot_moe._run_dequantized``).

    python benchmarks/bench_fp4_slots.py --out OUT.json [--format mxfp4|nvfp4] [--sweep]

CUDA. GPT-OSS-120B's MoE shape by default (MXFP4: H = I = 2880, E = 128, top-4, BF16
biases, SwiGLU with alpha 1.702 and limit 7 on interleaved gate/up rows); ``--format nvfp4``
takes silu and no biases (Qwen3-MoE's NVFP4). Random codes, scales (and biases) fill slot
banks of ``--slots`` slots, taken as layers of E experts; each of a graph's ``--calls`` calls
reads its own layer's slots with its own random routing, so calls do not find the previous
call's experts in L2. Each path is captured as one CUDA graph of ``--calls`` calls and replayed
(``bench_layer_overhead.per_call_us``). Per batch size T (``--batch-sizes``, run through the
direct kernels whether or not T*k is within ``slot_moe.DIRECT_FP4_MAX_PAIRS``): microseconds
per call of each path, their ratio, the max abs difference of the two outputs (and in bf16
ulps of the output's largest value), the weight bytes the direct kernels read (every pair's
expert once: codes, scales, scale_2, biases) and the implied GB/s. ``--sweep`` also times
the direct kernels under a few other block configurations (``fp4_moe.DEFAULT_BLOCKS``).

``--tiny``: a tiny shape on CPU tensors in Triton's interpreter (the test suite's stand-ins
for SGLang's CUDA-only pieces), one eager call per path: checks that the pieces run and agree;
its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

#: Block configurations ``--sweep`` times besides the default (overrides of DEFAULT_BLOCKS).
SWEEP = (
    {"BLOCK_N": 8, "BLOCK_H": 4},
    {"BLOCK_N": 32, "BLOCK_H": 16},
    {"BLOCK_K1": 64, "BLOCK_K2": 64},
    {"BLOCK_K1": 256, "BLOCK_K2": 256},
    {"WARPS_UP": 8, "WARPS_DOWN": 8},
    {"WARPS_UP": 2, "WARPS_DOWN": 2},
)


def setup_sglang(workdir: str, backend: str) -> None:
    """Publish server arguments for a tiny checkpoint and make a one-process group (as
    ``bench_layer_overhead.setup_sglang``, with the process-group backend given)."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.network import get_free_port

    from freetoken_sglang.tiny_models import TinyShape, build_tiny_checkpoint

    path = build_tiny_checkpoint("qwen3_moe", os.path.join(workdir, "tiny"),
                                 TinyShape(head_dim=64), dtype="bfloat16")
    publish(ServerArgs(model_path=path), role="bench")
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend=backend,
                                    distributed_init_method=f"tcp://127.0.0.1:{get_free_port()}")
    ps.initialize_model_parallel(tensor_model_parallel_size=1)


def make_banks(label: str, S: int, H: int, I: int, bias: bool, device, gen) -> dict:
    """Random FP4 slot banks under SGLang's names: uniform codes; MXFP4 scales 2^-9..2^-4,
    NVFP4 e4m3 scales in [0.05, 0.55) and scale_2 in [0.01, 0.11); BF16 biases ~ N(0, 0.1)."""
    kw = dict(device=device, generator=gen)
    banks = {"w13_weight": torch.randint(0, 256, (S, 2 * I, H // 2), dtype=torch.uint8, **kw),
             "w2_weight": torch.randint(0, 256, (S, H, I // 2), dtype=torch.uint8, **kw)}
    for p, (r, c) in (("w13", (2 * I, H)), ("w2", (H, I))):
        if label == "mxfp4":
            banks[f"{p}_weight_scale"] = torch.randint(118, 124, (S, r, c // 32),
                                                       dtype=torch.uint8, **kw)
        else:
            banks[f"{p}_weight_scale"] = (torch.rand(S, r, c // 16, **kw) * 0.5 + 0.05).to(
                torch.float8_e4m3fn)
        if bias:
            banks[f"{p}_weight_bias"] = (torch.randn(S, r, **kw) * 0.1).to(torch.bfloat16)
    if label == "nvfp4":
        banks["w13_weight_scale_2"] = torch.rand(S, 2, **kw) * 0.1 + 0.01
        banks["w2_weight_scale_2"] = torch.rand(S, **kw) * 0.1 + 0.01
    return banks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", choices=("mxfp4", "nvfp4"), default="mxfp4")
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--intermediate", type=int, default=2880)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--activation", choices=("gpt-oss", "silu"), default=None,
                    help="GPT-OSS's SwiGLU (alpha 1.702, limit 7, interleaved) or silu * up; "
                         "default gpt-oss for mxfp4, silu for nvfp4")
    ap.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                    help="expert biases (default: with mxfp4, as GPT-OSS)")
    ap.add_argument("--slots", type=int, default=512, help="slots of the banks (layers of E)")
    ap.add_argument("--calls", type=int, default=36, help="layer calls per graph")
    ap.add_argument("--reps", type=int, default=10, help="replays timed")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP block configs")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny shape on the CPU in Triton's interpreter (a smoke check)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.tiny:  # before SGLang and Triton are imported (the tests' CPU recipe)
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        sys.path[:0] = [os.path.join(HERE, "..", "tests", "stubs"),
                        os.path.join(HERE, "..", "tests")]
        a.hidden, a.intermediate, a.experts, a.slots, a.calls = 64, 64, 8, 16, 1
        a.batch_sizes = "1,2"
        a.sweep = False
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --tiny)")
    label, E, k, H, I, S = a.format, a.experts, a.top_k, a.hidden, a.intermediate, a.slots
    act = a.activation or ("gpt-oss" if label == "mxfp4" else "silu")
    bias = (label == "mxfp4") if a.bias is None else a.bias
    if S < E:
        ap.error(f"--slots must hold one layer's {E} experts")

    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

    from freetoken_sglang.execute import slot_moe
    from freetoken_sglang.experts.formats import FORMATS
    from freetoken_sglang.kernels import fp4_moe

    dev = "cpu" if a.tiny else "cuda"
    setup_sglang(tempfile.mkdtemp(), "gloo" if a.tiny else "nccl")
    if a.tiny:
        import pytest
        from test_fp4_slots_interpreter import sglang_in_the_interpreter

        sglang_in_the_interpreter(pytest.MonkeyPatch())
        per_call_us = None
    else:
        sys.path.insert(0, HERE)
        from bench_layer_overhead import per_call_us

    gen = torch.Generator(device=dev).manual_seed(0)
    banks = make_banks(label, S, H, I, bias, dev, gen)
    fmt = FORMATS[label]
    extra = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0) if act == "gpt-oss" else {}
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H,
                          intermediate_size_per_partition=I, top_k=k,
                          params_dtype=torch.bfloat16, activation="silu", inplace=False, **extra)
    tq = fmt.triton(None)
    layer = SimpleNamespace(
        moe_runner_config=cfg,
        w13_weight=torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, device="meta"),
        w2_weight=torch.empty(E, H, I // 2, dtype=torch.uint8, device="meta"),
        quant_method=SimpleNamespace(format=fmt, base_method=None, triton_quant=tq))
    code = fp4_moe.activation_code(cfg.activation, cfg.is_gated, cfg.gemm1_alpha,
                                   cfg.gemm1_clamp_limit, cfg.swiglu_limit,
                                   cfg.gate_up_interleaved)
    layers = S // E
    layer_slots = [torch.arange(l * E, (l + 1) * E, dtype=torch.int32, device=dev)
                   for l in range(layers)]
    rows = {}
    for T in (int(t) for t in a.batch_sizes.split(",")):
        x = (torch.randn(T, H, device=dev, generator=gen)).to(torch.bfloat16)
        logits = torch.randn(a.calls, T, E, device=dev, generator=gen)
        weights, ids = torch.topk(logits.softmax(-1), k)
        ids = ids.to(torch.int32)

        def direct(i):
            return slot_moe._run_direct_fp4(layer, code, x, weights[i], ids[i],
                                            layer_slots[i % layers], banks, False)

        def dequantized(i):
            return slot_moe._run_dequantized(layer, tq, x, weights[i], ids[i],
                                             layer_slots[i % layers], banks, False, False)

        got, want = direct(0), dequantized(0)
        diff = (got.float() - want.float()).abs().max().item()
        top = want.float().abs().max().item()
        ulp = 2.0 ** (torch.tensor(max(top, 1e-30)).log2().floor().item() - 7)
        read = fp4_moe.fp4_moe_bytes(T, k, H, I, nv=label == "nvfp4", bias=bias)
        row = {"pairs": T * k, "direct_path": T * k <= slot_moe.DIRECT_FP4_MAX_PAIRS,
               "distinct_experts": int(ids[0].unique().numel()),
               "max_abs_diff": diff, "max_abs_out": top, "diff_in_ulps_of_max": diff / ulp,
               "direct_bytes_read": read}
        if per_call_us is None:  # --tiny: one eager call each, nothing timed meaningfully
            for name, fn in (("direct_us", direct), ("dequantized_us", dequantized)):
                t0 = time.perf_counter()
                fn(0)
                row[name] = (time.perf_counter() - t0) * 1e6
        else:
            row["direct_us"] = per_call_us(direct, a.calls, a.reps)
            row["dequantized_us"] = per_call_us(dequantized, a.calls, a.reps)
            if a.sweep:
                default = fp4_moe.DEFAULT_BLOCKS
                for conf in SWEEP:
                    fp4_moe.DEFAULT_BLOCKS = {**default, **conf}
                    try:
                        name = ",".join(f"{n}={v}" for n, v in conf.items())
                        row[f"direct_us[{name}]"] = per_call_us(direct, a.calls, a.reps)
                    finally:
                        fp4_moe.DEFAULT_BLOCKS = default
        row["speedup"] = row["dequantized_us"] / row["direct_us"]
        row["direct_GBps"] = read / (row["direct_us"] * 1e-6) / 1e9
        rows[T] = row
        print(json.dumps({"T": T, **{n: (round(v, 3) if isinstance(v, float) else v)
                                     for n, v in row.items()}}), flush=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "activation": act, "bias": bias,
                   "blocks": fp4_moe.DEFAULT_BLOCKS,
                   "direct_fp4_max_pairs": slot_moe.DIRECT_FP4_MAX_PAIRS,
                   "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                   "rows": rows}, f, indent=1)
    print(f"\n{label} H={H} I={I} E={E} top-{k} ({act}, bias={bias}), us per layer call"
          + (" (--tiny: interpreter, eager, not timings)" if a.tiny else ""))
    print("| T | pairs | direct us | dequantized us | speedup | direct MB read | direct GB/s "
          "| max abs diff (ulps of max) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T, r in rows.items():
        print(f"| {T} | {r['pairs']}{'' if r['direct_path'] else ' (>max)'} | "
              f"{r['direct_us']:.1f} | {r['dequantized_us']:.1f} | {r['speedup']:.2f}x | "
              f"{r['direct_bytes_read'] / 1e6:.1f} | {r['direct_GBps']:.0f} | "
              f"{r['max_abs_diff']:.3g} ({r['diff_in_ulps_of_max']:.2f}) |")
    sweep = [n for n in next(iter(rows.values())) if n.startswith("direct_us[")]
    if sweep:
        print("\n| T | default | " + " | ".join(n[10:-1] for n in sweep) + " |")
        print("|---:|---:|" + "---:|" * len(sweep))
        for T, r in rows.items():
            print(f"| {T} | {r['direct_us']:.1f} | "
                  + " | ".join(f"{r[n]:.1f}" for n in sweep) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
