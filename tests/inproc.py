"""Load a model with FreeToken inside this process through SGLang's own ``ModelRunner``
(``sglang.benchmark.one_batch.load_model``), for tests that inspect the host pool directly.

Run as ``python tests/inproc.py CHECK MODEL_PATH [JSON_KWARGS]``; prints one JSON line. Each
check runs in its own process because SGLang's runtime context is process-global.
"""

from __future__ import annotations

import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(HERE, "stubs"))


# ServerArgs of the CPU recipe (README: "Running on the CPU"), with FreeToken on.
CPU_SERVER_ARGS = dict(
    device="cpu",
    attention_backend="torch_native",
    sampling_backend="pytorch",
    disable_cuda_graph=True,
    dtype="float32",
    enable_freetoken=True,
)


def load_model_runner(model_path: str, **server_kwargs):
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.benchmark.one_batch import load_model
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    sa = ServerArgs(
        model_path=model_path, max_total_tokens=1024, **{**CPU_SERVER_ARGS, **server_kwargs}
    )
    publish(sa, role="test")
    initialize_moe_config(sa)
    runner, _ = load_model(sa, PortArgs.init_new(sa), 0, 0)
    return getattr(runner, "torch_runner", runner)  # the bench wrapper's ModelRunner


_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w2|w3)\."
    r"(weight|weight_scale_inv|weight_scale|weight_scale_2|input_scale)$"
)
_FUSED_MXFP4 = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj_blocks|gate_up_proj_scales|"
    r"gate_up_proj_bias|down_proj_blocks|down_proj_scales|down_proj_bias)$"
)
_FUSED_BANK = {"gate_up_proj_blocks": "w13_weight", "gate_up_proj_scales": "w13_weight_scale",
               "gate_up_proj_bias": "w13_weight_bias", "down_proj_blocks": "w2_weight",
               "down_proj_scales": "w2_weight_scale", "down_proj_bias": "w2_weight_bias"}
_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def check_pool_layout(model_path: str, **kw) -> dict:
    """Compare every host-pool bank row ``l*E + e`` with the checkpoint's expert tensors."""
    import torch
    from safetensors import safe_open

    from freetoken_sglang.runtime import get_runtime

    model_runner = load_model_runner(model_path, **kw)
    rt = get_runtime()
    pool = rt.pool
    E = pool.num_experts
    seen = set()
    mismatches = []
    with safe_open(os.path.join(model_path, "model.safetensors"), "pt") as f:
        for key in f.keys():
            m = _EXPERT.match(key)
            if not m:
                continue
            layer, expert, kind = int(m.group(1)), int(m.group(2)), _KIND[m.group(3)]
            suffix = "_" + m.group(4)  # weights, FP8/NVFP4 block scales, per-tensor scales
            want = f.get_tensor(key)
            row = pool.ordinal(layer) * E + expert
            w13, w2 = pool.banks["w13" + suffix], pool.banks["w2" + suffix]
            if kind == "down":
                got = w2[row]
            elif w13.dim() == 1:  # one per-tensor scale per expert
                got = w13[row]
            elif w13.dim() == 2:  # per-tensor scales [gate, up] per expert
                got = w13[row, int(kind == "up")]
            else:  # gate rows (or scale-block rows), then up
                half = w13.shape[1] // 2
                got = w13[row, :half] if kind == "gate" else w13[row, half:]
            # bit for bit: the pool holds the checkpoint's own codes and scales
            if got.dtype != want.dtype or not torch.equal(
                    got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                mismatches.append(key)
            seen.add((row, kind + suffix))
    # GPT-OSS's fused MXFP4 tensors ([E, ...] per layer); where SGLang padded the experts
    # (its CPU engine), the rest of each row holds the initial values of SGLang's method
    with safe_open(os.path.join(model_path, "model.safetensors"), "pt") as f:
        for key in f.keys():
            m = _FUSED_MXFP4.match(key)
            if not m:
                continue
            layer, bank = int(m.group(1)), _FUSED_BANK[m.group(2)]
            want = f.get_tensor(key)
            got = pool.banks[bank][pool.ordinal(layer) * E:(pool.ordinal(layer) + 1) * E]
            if want.dim() == 4:  # blocks [E, R, K/32, 16]: the bank's [E, R, K/2]
                want = want.reshape(want.shape[0], want.shape[1], -1)
            init = 127 if bank.endswith("_scale") else 0  # Mxfp4MoEMethod's initial values
            part = got[tuple(slice(0, n) for n in want.shape)]
            rest = got.clone()
            rest[tuple(slice(0, n) for n in want.shape)] = init
            if not (torch.equal(part, want.to(got.dtype)) and bool((rest == init).all())):
                mismatches.append(key)
            seen.update((pool.ordinal(layer) * E + e, bank) for e in range(E))
    params_are_views = all(
        getattr(m, "w13_weight").data_ptr()
        == pool.banks["w13_weight"][pool.ordinal(m.layer_id) * E].data_ptr()
        for m in model_runner.model.modules()
        if type(m).__name__ == "FusedMoE"
    )
    return {
        "rows": pool.num_rows,
        "moe_layer_ids": pool.moe_layer_ids,
        "checked": len(seen),
        "mismatches": mismatches,
        "params_are_views": params_are_views,
        "expert_params_on_cpu": all(
            p.device.type == "cpu"
            for n, p in model_runner.model.named_parameters()
            if ".experts." in n and "shared" not in n
        ),
    }




def check_dummy_values(model_path: str, **kw) -> dict:
    """``--load-format dummy``: the host pool holds, in every MoE layer, the values stock
    SGLang's ``initialize_dummy_weights`` gives a parameter of that shape and dtype."""
    import torch
    from sglang.srt.model_loader import weight_utils

    from freetoken_sglang.runtime import get_runtime

    load_model_runner(model_path, load_format="dummy", **kw)
    pool = get_runtime().pool
    L, E = len(pool.moe_layer_ids), pool.num_experts
    out = {"layers": L, "banks": {}}
    for name, bank in pool.banks.items():
        holder = torch.nn.Module()
        # what SGLang's create_weights gives the parameter: stock's dummy load keeps it for
        # integer parameters (MXFP4's codes 0 and e8m0 scales _UE8M0_ONE, a private constant
        # of sglang/srt/layers/quantization/mxfp4.py)
        init = 0
        if bank.dtype == torch.uint8 and name.endswith("_weight_scale"):
            from sglang.srt.layers.quantization.mxfp4 import _UE8M0_ONE as init
        holder.w = torch.nn.Parameter(
            torch.full((E, *pool.specs[name].shape), init, dtype=bank.dtype),
            requires_grad=False)
        weight_utils.initialize_dummy_weights(holder)  # stock's own values (no FreeToken layer)
        rows = bank.view(L, E, *pool.specs[name].shape)
        bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # (FP8: no equal)
        out["banks"][name] = {
            "layers_equal_to_stock": [bool(torch.equal(bits(rows[l]), bits(holder.w.data)))
                                      for l in range(L)],
            "nonzero": bool(holder.w.float().abs().sum() > 0),
        }
    return out


def check_engine(model_path: str, resize_to=None, **kw) -> dict:
    """``sglang.Engine(..., enable_freetoken=True, freetoken_*=...)``: generate and read the
    counters through ``get_server_info``; with ``resize_to``, then resize the cache to that
    many slots (``freetoken_sglang.resize_cache``), try a refused size (1 slot) and generate
    the same again."""
    import sglang as sgl

    import freetoken_sglang

    engine = sgl.Engine(
        model_path=model_path,
        max_total_tokens=2048,
        max_running_requests=4,
        skip_server_warmup=True,
        **CPU_SERVER_ARGS,
        **kw,
    )
    try:
        out = engine.generate(
            input_ids=[[5, 6, 7, 8], [9, 10, 11]],
            sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
        )
        stats = engine.get_server_info()["internal_states"][0]["freetoken"]
        result = {"output_ids": [o["output_ids"] for o in out], "stats": stats}
        if resize_to is not None:
            result["resize"] = freetoken_sglang.resize_cache(engine, slots=resize_to)
            try:
                freetoken_sglang.resize_cache(engine, slots=1)
            except ValueError as e:
                result["refused"] = str(e)
            again = engine.generate(
                input_ids=[[5, 6, 7, 8], [9, 10, 11]],
                sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
            )
            result["output_ids_after"] = [o["output_ids"] for o in again]
            result["stats_after"] = engine.get_server_info()["internal_states"][0]["freetoken"]
    finally:
        engine.shutdown()
    return result


CHECKS = {"pool_layout": check_pool_layout, "engine": check_engine,
          "dummy_values": check_dummy_values}

def run_check(check: str, model_path: str, **kw) -> dict:
    """Run ``check`` in a fresh Python process and return its JSON result.

    Raises:
        AssertionError: the process failed; the message holds its output.
    """
    import subprocess

    from sglang_cpu import cpu_env

    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), check, model_path, json.dumps(kw)],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    check, path = sys.argv[1], sys.argv[2]
    kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    result = CHECKS[check](path, **kwargs)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":  # Engine spawns processes: keep the entry point importable
    main()
