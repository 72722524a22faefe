"""What one all-hit MoE layer call costs on each path, under CUDA-graph replay (CUDA only).

    python benchmarks/bench_layer_overhead.py --out OUT.json

The Qwen3-30B-A3B MoE shape by default (E=128, top-8, hidden 2048, expert 768, bf16), every
routed expert resident in a cache of ``layers * E`` slots. Each variant is captured as one
graph of ``--calls`` layer calls (ordinals cycling over the layers) and replayed; the table
gives microseconds per layer call at each batch size, and for whole MoE calls (stock,
resident, slots, lru) the excess over stock SGLang's ``fused_experts`` on the layer's own
``[E, ...]`` weights:

- ``stock``: SGLang's ``fused_experts``;
- ``resident``: the resident executor's call (the layer's slice of the slot banks, no remap);
- ``slots``: the LRU path's MoE over slots (token alignment, remap to slots, the GEMMs);
- ``decide``, ``fill``, ``remap``: the decision kernel, the fill launch with nothing to
  fill, the remap kernel alone;
- ``lru``: ``DecodeExecutor.run``'s whole all-hit call under the fill policy (decide on a
  side stream beside the alignment, then the fill launch that also remaps the block ids, the
  GEMMs); ``lru-seq``: the same with the decision before the alignment on one stream
  (``OVERLAP_DECISION`` off: the A/B of the overlap); ``lru-sep``:
  the same with the fill before the alignment and the remap a kernel of its own (as before
  they were one launch: the A/B of that change);
- ``qstar``: ``DecodeExecutor.run``'s whole all-hit call under q* with the admission rule
  (``MissSplit.may_run_cpu``: CPU entries read from the null slot; the decision on a side
  stream beside the alignment, ``OVERLAP_CPU_POLICIES``) and the doorbell CPU
  branch, which has no CPU item to run: its post and merge folded into the decision kernel
  and the MoE's sum (``CpuBranch.fold``); ``qstar-sep``: the same with the post and the
  merge as kernels of their own, as before they were folded (the A/B of that change);
  ``qstar-seq``: ``qstar`` with its decision before the alignment, not beside it
  (``OVERLAP_CPU_POLICIES`` off: the A/B of that overlap); ``qstar-filter``: ``qstar`` with
  its CPU entries skipped by ``filter_expert`` instead of read from the null slot
  (``CPU_ENTRIES_READ_NULL_SLOT`` off: the A/B of that change);
- ``decide-full``: ``decide`` without the decision kernel's hit path (``DECIDE_HIT_PATH``
  off: the q table read and the CPU routing's reduction on every call); ``decide-acqrel``:
  ``decide`` with the counters' atomic adds fenced (``DECIDE_COUNTER_SEM="acq_rel"``);
- ``decide-q``, ``decide-q-post``: the decision kernel under q*'s split (the admission rule),
  without and with the doorbell post; ``slots-neg``: ``slots`` with ``filter_expert`` (CPU
  entries masked); ``slots-null``: ``slots`` with CPU entries read from the null slot (no
  ``filter_expert``); ``slots-merge``: that with the doorbell's merging sum in place of SGLang's
  (no CPU item): the parts of ``qstar``'s excess over ``lru``;
- ``slots-merge@BxW`` (``--reduce-configs``): ``slots-merge`` with the merging sum's blocks
  of B hidden elements and W warps;
- ``decide@BxW`` (``--decide-configs``): the decision kernel with loops of B routed entries
  and W warps;
- ``decide-miss`` (and ``decide-miss@BxW``): the decision kernel when every routed expert
  misses and is filled: each call is its own layer, through an LRU of ``--miss-slots`` slots
  smaller than the graph's working set (``--calls`` x top-k or more), so each call evicts
  and plans top-k (bs1) to ``T*k`` fills (the fills themselves are not run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from unittest import mock

import torch


def setup_sglang(workdir: str) -> None:
    """SGLang's MoE kernels read the server arguments a server publishes and ask for the
    tensor-parallel group: publish them for a tiny checkpoint and make a one-process group."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.network import get_free_port

    from freetoken_sglang.tiny_models import TinyShape, build_tiny_checkpoint

    path = build_tiny_checkpoint("qwen3_moe", os.path.join(workdir, "tiny"),
                                 TinyShape(head_dim=64), dtype="bfloat16")
    publish(ServerArgs(model_path=path), role="bench")
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="nccl",
                                    distributed_init_method=f"tcp://127.0.0.1:{get_free_port()}")
    ps.initialize_model_parallel(tensor_model_parallel_size=1)


def per_call_us(fn, calls: int, reps: int) -> float:
    """Microseconds per layer call of ``fn(i)`` for i in range(calls), captured as one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):  # warm-up: Triton compiles outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    for _ in range(3):
        g.replay()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / (reps * calls)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12, help="resident layers the calls cycle over")
    ap.add_argument("--calls", type=int, default=48, help="layer calls per graph")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--decide-configs", default="",
                    help="also time the decision kernel with these BLOCKxWARPS configs "
                         "(e.g. 16x1,16x4,64x1)")
    ap.add_argument("--reduce-configs", default="",
                    help="comma-separated BLOCKxWARPS of the doorbell's merging sum to time "
                         "as slots-merge@BxW (e.g. 256x2,512x4)")
    ap.add_argument("--miss-slots", type=int, default=256,
                    help="slots of the all-miss decision variant (fewer than --calls x top-k)")
    ap.add_argument("--variants", default="",
                    help="time only these variants (comma-separated names of the table)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from types import SimpleNamespace

    from freetoken_sglang.cache.residency import FILL_ALL, MissSplit, ResidencyState, decide
    from freetoken_sglang.cpu.branch import CpuBranch
    from freetoken_sglang.cpu.executor import CpuExpertExecutor
    from freetoken_sglang.execute.contract import LayerCall
    from freetoken_sglang.execute import decode as decode_mod
    from freetoken_sglang.execute.decode import DecodeExecutor
    from freetoken_sglang.execute.slot_moe import run_on_slots_triton
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer
    from freetoken_sglang.kernels.fill import copy_rows_banks
    from freetoken_sglang.kernels import residency as residency_kernels
    from freetoken_sglang.kernels.residency import remap_expert_ids_

    setup_sglang(tempfile.mkdtemp())
    E, k, H, I, L = a.experts, a.top_k, a.hidden, a.intermediate, a.layers
    dev, bf16 = "cuda", torch.bfloat16
    S = L * E
    # the slots, then one all-zero row: the null slot q*'s CPU entries read
    with_null = {"w13_weight": torch.randn(S + 1, 2 * I, H, device=dev, dtype=bf16) * 0.02,
                 "w2_weight": torch.randn(S + 1, H, I, device=dev, dtype=bf16) * 0.02}
    for b in with_null.values():
        b[S].zero_()
    slots = {n: b[:S] for n, b in with_null.items()}
    per_layer = [{n: b[l * E:(l + 1) * E] for n, b in slots.items()} for l in range(L)]
    state = ResidencyState(S, S, dev)
    state.make_all_resident()
    counters = torch.zeros(5, L, dtype=torch.int64, device=dev)
    # The all-miss variant: each of the graph's calls is its own layer, so one replay reads
    # at least calls * top-k distinct experts, more than its slots: LRU misses every read.
    LM = a.calls
    max_t = max(int(x) for x in a.batch_sizes.split(","))
    if not max_t * k <= a.miss_slots < LM * k:
        ap.error(f"--miss-slots must be at least {max_t * k} (a call's reads) and below "
                 f"{LM * k} (--calls x top-k) for every call to miss: raise --calls")
    miss_state = ResidencyState(LM * E, a.miss_slots, dev)
    miss_counters = torch.zeros(5, LM, dtype=torch.int64, device=dev)
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H,
                          intermediate_size_per_partition=I, top_k=k, params_dtype=bf16,
                          activation="silu", inplace=False)
    # q*'s CPU branch (doorbell) over a small host pool: an all-hit call gives it no item
    host_pool = HostExpertPool([0], 8, bank_specs_for_layer(H, I, bf16))
    cpu_executor = CpuExpertExecutor(host_pool.banks, num_threads=2)
    branch = CpuBranch(cpu_executor, torch.device(dev), H, k, bf16, max_rows=max_t)
    names = list(slots)
    cache = SimpleNamespace(
        residency=state, num_experts=E, slot_banks=slots, late=SimpleNamespace(pending=False),
        banks_with_null_slots=with_null, null_slot=S,
        filler=SimpleNamespace(run=lambda plan, remap=None: copy_rows_banks(
            [slots[n] for n in names], [slots[n] for n in names], plan.src, plan.dst,
            plan.count, remap=remap)))
    qstar_split = MissSplit(0.5, 1, admit_reuse=True)
    assert qstar_split.may_run_cpu
    policy = {"split": qstar_split}
    runtime = SimpleNamespace(cache=cache, split_for=lambda rows: policy["split"],
                              is_decode_sized=lambda rows: True, cpu_branch=branch,
                              counters=SimpleNamespace(of_phase=lambda phase: counters))
    executor = DecodeExecutor(runtime)
    rows = {}
    for T in (int(x) for x in a.batch_sizes.split(",")):
        x = torch.randn(T, H, device=dev, dtype=bf16)
        logits = torch.randn(T, E, device=dev)
        w, ids = torch.topk(logits.softmax(-1), k)
        ids = ids.to(torch.int32)
        topk = StandardTopKOutput(w, ids, logits)
        num_valid = torch.tensor([T], dtype=torch.int32, device=dev)
        layers = [SimpleNamespace(moe_runner_config=cfg, w13_weight=p["w13_weight"],
                                  w2_weight=p["w2_weight"]) for p in per_layer]
        expert_ids = torch.randint(0, E, (max(64, T * k * 4),), device=dev, dtype=torch.int32)
        src = torch.zeros(E, dtype=torch.int32, device=dev)
        count = torch.zeros(1, dtype=torch.int32, device=dev)
        runtime.num_valid = num_valid
        calls = [LayerCall(layer=layers[o], ordinal=o, x=x, topk_weights=w, topk_ids=ids,
                           topk_output=topk) for o in range(L)]

        def qstar(i, fold=True):
            policy["split"] = qstar_split
            branch.fold = fold
            executor.run(calls[i % L])

        def lru(i):
            policy["split"] = FILL_ALL
            executor.run(calls[i % L])

        def flipped(module, name, value, fn):
            """``fn`` with ``module.name`` set to ``value`` for the call (the A/B variants)."""
            def run(i):
                with mock.patch.object(module, name, value):
                    fn(i)
            return run

        def decide_plain(i):
            decide(state, counters, i % L, E, ids, w, num_valid)

        def lru_sep(i):
            o = i % L
            d = decide(state, counters, o, E, ids, w, num_valid)
            copy_rows_banks([slots[n] for n in names], [slots[n] for n in names],
                            d.plan.src, d.plan.dst, d.plan.count)
            run_on_slots_triton(layers[o], x, w, d.routed_ids, state.layer_slots(o, E), slots)

        def slots_merge(i):
            # the q* path's MoE alone: CPU entries masked (filter_expert) and its sum-reduce
            # replaced by the doorbell's reduce_merge with no CPU item (count 0)
            from freetoken_sglang.kernels import doorbell
            from freetoken_sglang.patches.fused_moe import sum_reduce_replaced

            def replacing(original):
                return lambda e_out, out, scale: doorbell.reduce_merge(
                    e_out, out, scale, count, branch.seq_dev, branch._uva["done"],
                    branch._uva["out"], branch._uva["status"])
            with sum_reduce_replaced(replacing):
                run_on_slots_triton(layers[i % L], x, w, ids, state.layer_slots(i % L, E),
                                    slots, skip_negative_ids=True)

        variants = {
            "stock": lambda i: fused_experts(x, per_layer[i % L]["w13_weight"],
                                             per_layer[i % L]["w2_weight"], topk, cfg),
            "resident": lambda i: run_on_slots_triton(layers[i % L], x, w, ids, None,
                                                      per_layer[i % L]),
            "slots": lambda i: run_on_slots_triton(layers[i % L], x, w, ids,
                                                   state.layer_slots(i % L, E), slots),
            "decide": decide_plain,
            "decide-full": flipped(residency_kernels, "DECIDE_HIT_PATH", False, decide_plain),
            "decide-acqrel": flipped(residency_kernels, "DECIDE_COUNTER_SEM", "acq_rel",
                                     decide_plain),
            "decide-q": lambda i: decide(state, counters, i % L, E, ids, w, num_valid,
                                         qstar_split),
            "decide-q-post": lambda i: decide(state, counters, i % L, E, ids, w, num_valid,
                                              qstar_split, post=branch.post_target(x)),
            "slots-neg": lambda i: run_on_slots_triton(layers[i % L], x, w, ids,
                                                       state.layer_slots(i % L, E), slots,
                                                       skip_negative_ids=True),
            "slots-null": lambda i: run_on_slots_triton(layers[i % L], x, w, ids,
                                                        state.layer_slots(i % L, E), with_null,
                                                        skip_negative_ids=True, null_slot=S),
            "slots-merge": slots_merge,
            "fill": lambda i: copy_rows_banks([slots[n] for n in names],
                                              [slots[n] for n in names], src, src, count),
            "remap": lambda i: remap_expert_ids_(expert_ids, state.layer_slots(i % L, E)),
            "lru": lru,
            "lru-seq": flipped(decode_mod, "OVERLAP_DECISION", False, lru),
            "lru-sep": lru_sep,
            "qstar": qstar,
            "qstar-sep": lambda i: qstar(i, fold=False),
            "qstar-seq": flipped(decode_mod, "OVERLAP_CPU_POLICIES", False, qstar),
            "qstar-filter": flipped(decode_mod, "CPU_ENTRIES_READ_NULL_SLOT", False, qstar),
            "decide-miss": lambda i: decide(miss_state, miss_counters, i % LM, E, ids, w,
                                            num_valid),
        }
        only = [v for v in a.variants.split(",") if v]
        unknown = sorted(set(only) - set(variants))
        if unknown:
            ap.error(f"unknown variants {unknown}; choose from {sorted(variants)}")
        miss_counters.zero_()
        got = {name: per_call_us(fn, a.calls, a.reps) for name, fn in variants.items()
               if not only or name in only}
        for conf in (x for x in a.reduce_configs.split(",") if x):
            from freetoken_sglang.kernels import doorbell as door

            if len(conf.split("x")) != 2:
                ap.error(f"--reduce-configs: {conf!r} is not BLOCKxWARPS (e.g. 512x4)")
            block, warps = (int(v) for v in conf.split("x"))
            default = door.REDUCE_BLOCK, door.REDUCE_WARPS
            door.REDUCE_BLOCK, door.REDUCE_WARPS = block, warps
            try:
                got[f"slots-merge@{conf}"] = per_call_us(slots_merge, a.calls, a.reps)
            finally:
                door.REDUCE_BLOCK, door.REDUCE_WARPS = default
        for conf in (x for x in a.decide_configs.split(",") if x):
            block, warps = (int(v) for v in conf.split("x"))
            kern = residency_kernels
            default = kern.DECIDE_BLOCK, kern.DECIDE_WARPS
            kern.DECIDE_BLOCK, kern.DECIDE_WARPS = block, warps
            try:
                got[f"decide@{conf}"] = per_call_us(variants["decide"], a.calls, a.reps)
                got[f"decide-miss@{conf}"] = per_call_us(variants["decide-miss"], a.calls,
                                                         a.reps)
            finally:
                kern.DECIDE_BLOCK, kern.DECIDE_WARPS = default
        reads, hits = int(miss_counters[0].sum()), int(miss_counters[1].sum())
        assert hits == 0 and (reads > 0 or "decide-miss" not in got), \
            f"bs{T}: the all-miss variant hit {hits} of {reads} reads"
        rows[T] = got
        print(json.dumps({"batch": T, **{n: round(v, 2) for n, v in got.items()}}), flush=True)
    assert int(counters[2].sum()) == 0, "an all-hit benchmark filled experts"
    assert int(counters[4].sum()) == 0 and branch.doorbell.served == 0, \
        "an all-hit benchmark ran experts on the CPU"
    branch.close()
    cpu_executor.close()
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "us_per_layer_call": rows,
                   "device": torch.cuda.get_device_name()}, f, indent=1)
    # whole MoE calls: their excess over stock
    whole = ("stock", "resident", "slots", "lru", "lru-seq", "lru-sep", "qstar", "qstar-sep",
             "qstar-seq", "qstar-filter")
    print("| path | " + " | ".join(f"bs{T} us/call | bs{T} over stock" for T in rows) + " |")
    print("|---|" + "---:|---:|" * len(rows))
    for name in rows[next(iter(rows))]:
        cells = [f"{rows[T][name]:.2f} | " + (f"{rows[T][name] - rows[T]['stock']:+.2f}"
                                              if name in whole and "stock" in rows[T] else "-")
                 for T in rows]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
