"""The decode executor: the LRU residency decision, fills and the miss policy's CPU branch
(paper §3.2, §4.1). Graph-safe: no host sync on CUDA."""

from __future__ import annotations

import contextlib

import torch

from freetoken_sglang.cache.residency import decide
from freetoken_sglang.execute.contract import LayerCall
from freetoken_sglang.execute.slot_moe import aligns_before_fill, run_on_slots, routed_scale


def _late_slots_kept(cache, call: LayerCall) -> bool:
    """Whether no victim of this forward can be a slot late-filled earlier in it: a forward
    stamps at most ``L * K`` slots (K: the call's most distinct experts), so with more LRU
    slots than that, a slot stamped by an earlier call of the forward is never the least
    recently used within it."""
    from freetoken_sglang.cache.residency import max_unique_experts

    t, k = call.topk_ids.shape
    per_call = max_unique_experts(t, k, cache.num_experts)
    return cache.residency.num_slots > cache.pool.num_layers * per_call


#: On CUDA, where SGLang's alignment precedes the fill (``aligns_before_fill``: not FP4), a
#: call under the fill policy runs its decision on a side stream beside the alignment of the
#: router's own ids, joined before the fill; False runs them one after the other
#: (bench_layer_overhead.py's lru against lru-seq). Without CPU work the decision's ids
#: differ from the router's only in padded rows (it gives them row 0's experts), whose output
#: is discarded: there a non-resident expert reads slot 0. (The router's ids are in [0, E):
#: SGLang masks padded rows to -1 only under expert parallelism, which FreeToken refuses.)
OVERLAP_DECISION = True
#: The same for calls that may send experts to the CPU (q*, cpu), where the decision posts
#: the CPU work itself (the doorbell, ``CpuBranch.post_target``) and there is no late fill (a
#: late-filled expert runs on the CPU in this call, yet its slot is already in the residency
#: table when the remap reads it): a CPU expert's blocks get the null slot from the remap
#: (``CPU_ENTRIES_READ_NULL_SLOT``), or -1 and ``filter_expert`` zeroes them. False runs
#: them in order (bench_layer_overhead.py's qstar against qstar-seq; tests/test_gpu.py's
#: test_qstar_decision_beside_the_alignment_changes_no_output).
OVERLAP_CPU_POLICIES = True
#: Decode-sized calls that may send experts to the CPU compute their CPU entries against the
#: cache's all-zero null slot (``ExpertCache.null_slot``; exactly 0) instead of skipping
#: them, so SGLang's kernels run as stock's do, without ``filter_expert``: an all-hit call
#: costs what the fill policy's does. A call with CPU entries runs SGLang's GEMMs over the
#: zero row for their blocks: once per distinct CPU expert where the router's own ids are
#: aligned (``OVERLAP_CPU_POLICIES``), once for all of them otherwise; that GPU work runs
#: while the CPU partial is awaited (not measured yet; prefill-sized calls, whose CPU experts
#: have many rows, skip them). False skips them (bench_layer_overhead.py's qstar against
#: qstar-filter).
CPU_ENTRIES_READ_NULL_SLOT = True


class DecodeExecutor:
    """Hits run from their slots; of the m misses, q are filled into LRU victims and run on
    the GPU, the rest run on the CPU at the same time; the partial outputs are merged. With
    the late fill (``policy/miss.py``) a call that fills none of its misses also fills them
    after the call (``cache.late``, joined by the forward's last MoE layer).

    Args:
        runtime: the process's ``FreeTokenRuntime`` (cache, counters, miss policy, CPU
            branch, ``num_valid``).
    """

    name = "decode"

    def __init__(self, runtime):
        self.rt = runtime
        self._side = None  # the decision's stream (OVERLAP_DECISION)

    def _side_stream(self, call: LayerCall, split, post):
        """The stream the decision runs on beside the alignment, forked from the current one,
        or None (no overlap; ``OVERLAP_DECISION``, ``OVERLAP_CPU_POLICIES``)."""
        x = call.x
        if not (OVERLAP_DECISION and aligns_before_fill(call.layer, x)):
            return None
        if split.may_run_cpu and not (OVERLAP_CPU_POLICIES and post is not None
                                      and not split.late_fill):
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(device=x.device)
        self._side.wait_stream(torch.cuda.current_stream(x.device))
        return self._side

    def run(self, call: LayerCall) -> torch.Tensor:
        rt = self.rt
        cache = rt.cache
        x = call.x
        split = rt.split_for(call.rows)
        on_cpu = split.may_run_cpu  # some misses may run on the CPU (admission: at any ratio)
        branch = rt.cpu_branch if on_cpu else None
        # the doorbell: the decision kernel posts the CPU work itself (CpuBranch.fold)
        post = branch.post_target(x) if on_cpu else None
        phase = "decode" if rt.is_decode_sized(call.rows) else "prefill"
        side = self._side_stream(call, split, post)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            decision = decide(
                cache.residency,
                rt.counters.of_phase(phase),
                call.ordinal,
                cache.num_experts,
                call.topk_ids,
                call.topk_weights,
                rt.num_valid,
                split,
                routed_scale(call.layer, x),
                post=post,
            )
        if on_cpu:  # x is copied (or posted) before the GPU may overwrite it
            branch.launch(x, decision.cpu, posted=post is not None)
        if cache.late.pending and not _late_slots_kept(cache, call):
            # A forward that can stamp every other slot after a late fill may choose its slot
            # as a victim again: this call's fills then wait for the late copies (same link).
            cache.late.wait()

        joined = [side is None]

        def join():  # the decision's slots, before the remap reads them
            if not joined[0]:
                torch.cuda.current_stream(x.device).wait_stream(side)
                joined[0] = True

        def fill(remap):
            # launched by run_on_slots after the token alignment, remapping its block ids
            join()
            cache.filler.run(decision.plan, remap=remap)
            if decision.late is not None:  # the late fill: after this call, not waited for
                cache.late.launch(decision.late)

        # with the doorbell, the MoE's sum over top-k awaits and merges the CPU partial
        with branch.merging_reduce() if on_cpu else contextlib.nullcontext():
            try:
                out = run_on_slots(
                    call,
                    call.topk_ids if side is not None else decision.routed_ids,
                    cache.residency.layer_slots(call.ordinal, cache.num_experts),
                    cache,
                    skip_negative_ids=on_cpu,
                    fill=fill,
                    use_null_slot=on_cpu and CPU_ENTRIES_READ_NULL_SLOT and phase == "decode",
                )
            finally:  # joined even where run_on_slots raised before its fill
                join()
        if on_cpu:
            out = branch.merge(out)  # nothing left to launch where the sum merged it
        return out
