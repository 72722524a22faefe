"""Measure B_P, B_H and the branches' fixed costs for a model's expert shape on this machine and cache them (paper §3.2).

    python -m freetoken_sglang.profile --model-path Qwen/Qwen3-30B-A3B [--threads 16]

Reads only the model's config. B_P: pinned host-to-GPU fills of batches of experts, through
the cache's own fill path; B_H: the C executor's decode-like calls on the same expert shape,
over a scratch pool larger than the CPU caches; B_P' and B_H': both while the other runs
(``policy.rates.measure_beside``, for ``--freetoken-host-rates beside``); F_P and F_H: the intercepts of each branch's
time over its expert count (``policy.rates.measure_fill_fixed``, ``measure_executor_fixed``). The result goes to the JSON cache that
``--enable-freetoken`` servers read at start (``~/.cache/freetoken/bandwidth.json``), keyed by
GPU, CPU, thread count and expert shape.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from freetoken_sglang import families
from freetoken_sglang.experts.pool import GIB, HostExpertPool, bank_specs_for_layer
from freetoken_sglang.policy import rates


def scratch_pool(hf_config, pool_gb: float) -> HostExpertPool:
    """A pool of the model's expert shape holding about ``pool_gb`` GiB of random values."""
    hidden = int(families.text_config(hf_config).hidden_size)
    inter = families.expert_intermediate_size(hf_config)
    dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        dtype = torch.bfloat16
    specs = bank_specs_for_layer(hidden, inter, dtype)
    per_expert = sum(s.row_bytes for s in specs.values())
    total = len(families.moe_layer_ids(hf_config)) * families.num_routed_experts(hf_config)
    rows = max(8, min(total, int(pool_gb * GIB // per_expert)))
    pool = HostExpertPool([0], rows, specs)
    for bank in pool.banks.values():
        block = torch.empty(bank[0].shape, dtype=torch.float32).uniform_(-0.02, 0.02).to(bank.dtype)
        bank.copy_(block.expand_as(bank))
    return pool


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--threads", type=int, default=None, help="executor threads (default: physical cores)")
    ap.add_argument("--pool-gb", type=float, default=4.0, help="scratch pool size (GiB)")
    ap.add_argument("--cache", default=rates.DEFAULT_CACHE)
    ap.add_argument("--trust-remote-code", action="store_true")
    a = ap.parse_args(argv)
    from transformers import AutoConfig

    from freetoken_sglang.cpu.executor import CpuExpertExecutor

    hf_config = AutoConfig.from_pretrained(a.model_path, trust_remote_code=a.trust_remote_code)
    families.family_of(hf_config)
    if getattr(families.text_config(hf_config), "quantization_config", None) or getattr(
            hf_config, "quantization_config", None):
        raise SystemExit(
            "freetoken_sglang.profile measures unquantized expert shapes only; a server with "
            "a quantized checkpoint and --freetoken-miss-policy qstar measures B_P and B_H at "
            "its first start (or pass --freetoken-bandwidth B_P,B_H)"
        )
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t0 = time.perf_counter()
    pool = scratch_pool(hf_config, a.pool_gb)
    if device.type == "cuda" and not pool.pin():
        raise SystemExit(f"freetoken_sglang.profile: cannot pin the scratch pool ({pool.pin_error})")
    with CpuExpertExecutor(pool.banks, num_threads=a.threads) as ex:
        b_p = rates.measure_fill(pool.banks, pool.device_banks, device)
        hidden = int(families.text_config(hf_config).hidden_size)
        dtype = pool.specs["w13_weight"].dtype
        b_h = rates.measure_executor(ex, hidden, dtype, pool.expert_bytes)
        b_pb, b_hb = rates.measure_beside(pool.banks, pool.device_banks, device, ex,
                                          hidden, dtype, pool.expert_bytes)
        f_p = rates.measure_fill_fixed(pool.banks, pool.device_banks, device)
        f_h = rates.measure_executor_fixed(ex, hidden, dtype)
        shape = rates.expert_shape(pool.specs["w13_weight"])
        key = rates.machine_key(device, ex.num_threads, shape, ex.isa)
        entry = {
            "B_P": b_p,
            "B_H": b_h,
            "B_P_beside": b_pb,
            "B_H_beside": b_hb,
            "F_P_us": f_p,
            "F_H_us": f_h,
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": time.perf_counter() - t0,
            "isa": ex.isa,
            "pool_gb": pool.nbytes / GIB,
        }
    rates.store_cached(a.cache, key, entry)
    print(json.dumps({"key": key, **entry, "q_star_per_miss": b_p / b_h,
                      "q_star_per_miss_beside": b_pb / (b_pb + b_hb)}, indent=1))


if __name__ == "__main__":
    main()
