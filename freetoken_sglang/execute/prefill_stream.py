"""The prefill-stream executor: whole layers stream over PCIe into full-layer buffers,
double-buffered, while the previous layer computes (paper §3.1)."""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch

from freetoken_sglang.cache.fills import copy_row_runs, row_runs
from freetoken_sglang.execute.contract import LayerCall
from freetoken_sglang.execute.slot_moe import routed_scale, run_on_slots

# Fields of PrefillStreamExecutor.counts.
STREAM_FIELDS = ("layer_calls", "experts_streamed", "experts_reused", "lru_evicted",
                 "lru_seeded", "experts_cpu")


class PrefillStreamExecutor:
    """Serves each layer call of a streamed forward from a full-layer buffer.

    Layer ``l`` goes to buffer ``l % buffers``; ``buf_slots[b, e]`` is the slot that holds
    expert ``e`` of buffer ``b``'s layer. With two buffers, the copy of layer ``l + 2`` into a
    buffer starts as soon as layer ``l`` has computed from it, so one layer's transfer always
    overlaps the computation before it; with one buffer, each copy waits for the previous
    layer's compute (the no-overlap baseline). The first ``buffers`` layers are issued when
    the forward starts (``begin_forward``), before layer 0's attention runs.

    Buffers (``cache/layout.py``):

    - borrowed: at the start of a streamed forward the ``buffers * E`` least recently used LRU
      slots are lent out (their experts evicted: ``lru_evicted``); at its end they go back
      holding the streamed experts of the last ``buffers`` MoE layers as the most recent
      entries (``lru_seeded``), the rest empty and first to be taken. No other entry or
      recency changes.
    - reserved: fixed slot rows after the LRU's; the LRU is not touched at all.

    Experts resident in the LRU when the forward starts are not sent: the call reads them
    from their slots (``experts_reused``). With a CPU share (``--freetoken-prefill-cpu``,
    ``execute/prefill_cpu.py``) the last ``c`` non-resident experts of each layer are not sent
    either: the C executor runs their items while the GPU computes the rest
    (``experts_cpu``). Only the non-resident rows of the layer are copied,
    one ``cudaMemcpyAsync`` per run of consecutive rows and bank on a dedicated copy stream,
    from the pinned pool (the copy engine; no SM is taken from the compute). The residency
    table (and the borrowed slots) is read to the host once per streamed forward (one sync);
    it cannot change during that forward, since every layer call of it streams.

    On CUDA ``run`` is an eager break of SGLang's breakable prefill CUDA graph
    (``eager_on_graph``): it runs in Python on every replay.

    Args:
        runtime: the process's ``FreeTokenRuntime``.
    """

    name = "stream"

    def __init__(self, runtime):
        self.rt = runtime
        cache = runtime.cache
        self.cache = cache
        self.pool = cache.pool
        self.layout = cache.layout
        self.E = cache.num_experts
        self.L = self.pool.num_layers
        self.buffers = self.layout.buffers
        self.borrowed = self.layout.borrowed
        self.device = cache.device
        self.on_cuda = self.device.type == "cuda"
        i32 = dict(dtype=torch.int32, device=self.device)
        n = self.buffers * self.E
        if self.borrowed:
            self.buf_slots = torch.zeros((self.buffers, self.E), **i32)
        else:
            self.buf_slots = (torch.arange(n, **i32) + self.layout.lru_slots).view(
                self.buffers, self.E
            )
        self.buf_host: List[List[int]] = self.buf_slots.cpu().tolist()
        self.pending: Dict[int, Tuple[int, Optional[torch.cuda.Event]]] = {}
        # buffer -> the layer whose copy was issued into it last (what it holds once that
        # copy has landed)
        self.holds: Dict[int, int] = {}
        self.lent = False  # borrowed slots are out of the LRU until end_forward
        self.cpu_part = getattr(runtime, "prefill_cpu_part", None)
        # the CPU share's rule, as calibrated so far (execute/prefill_cpu.py)
        self.cpu_rule = self.cpu_part.rule if self.cpu_part is not None else None
        self.rows = 0  # the streamed forward's real rows (begin_forward)
        # layer -> (bool [E] on the device, count): its experts the CPU runs in this forward
        self.cpu_masks: Dict[int, Tuple[torch.Tensor, int]] = {}
        # buffer -> the same for the layer it holds (those experts were never copied into it)
        self.held_cpu: Dict[int, Tuple[torch.Tensor, int]] = {}
        self.res_host: Optional[torch.Tensor] = None
        self.counts = {k: 0 for k in STREAM_FIELDS}
        self.wait_s = 0.0
        self._timings: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # (started, loaded, experts) of issued copies, for the CPU share's calibration
        self._copies: List[Tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self._run = self._run_eager
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.free = [torch.cuda.Event() for _ in range(self.buffers)]
            # SGLang 0.5.17: sglang/srt/model_executor/runner_backend_utils/
            # breakable_cuda_graph (the break marker its attention layers use).
            from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
                eager_on_graph,
            )

            self._run = eager_on_graph(True)(self._run_eager)

    # ---- per forward ---------------------------------------------------------------------
    def begin_forward(self, prefetch: bool, rows: int = 0) -> None:
        """Start of a forward over ``rows`` real rows: forget the previous forward's buffers;
        when ``prefetch`` (the forward will stream), borrow the buffers, read the residency
        table and issue the first layers."""
        self.end_forward()
        self._harvest(block=False)
        self.rows = rows
        if prefetch:
            self._start()
            for ordinal in range(min(self.buffers, self.L)):
                self._issue(ordinal)

    def end_forward(self) -> None:
        """End of a forward (also one that raised): give borrowed buffers back to the LRU;
        its snapshot and buffers are no longer valid."""
        if self.cpu_part is not None:
            self.cpu_part.abandon()
        if self.lent:
            self._give_back()
        self.rows = 0
        self.pending.clear()
        self.holds.clear()
        self.cpu_masks.clear()
        self.held_cpu.clear()
        self.res_host = None

    def _start(self) -> None:
        """Borrow the buffers (borrowed layout, not while SGLang captures graphs), read the
        residency table and the buffer slots (one sync), and order this forward's copies after
        every kernel queued so far (the slots may be in use by earlier steps)."""
        LE = self.L * self.E
        st = self.cache.residency
        parts = [st.residency[:LE]]
        if self.borrowed and not self.rt.capturing:
            parts += [self.buf_slots.view(-1), self._borrow().view(1)]
        host = torch.cat(parts).cpu()
        self.res_host = host[:LE]
        if len(parts) > 1:
            n = self.buffers * self.E
            self.buf_host = host[LE : LE + n].view(self.buffers, self.E).tolist()
            self.counts["lru_evicted"] += int(host[-1])
        if self.on_cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream())

    def _borrow(self) -> torch.Tensor:
        """Lend the ``buffers * E`` least recently used LRU slots out as the buffers, in
        ascending slot order (never-used slots come first: their keys are the smallest), and
        evict their experts. Device ops only; returns the eviction count (int32 [] on the
        device)."""
        st = self.cache.residency
        S, n = st.num_slots, self.buffers * self.E
        slots = torch.topk(st.key, n, largest=False, sorted=False).indices.sort().values
        old = st.owner[slots]
        evicted = old >= 0
        st.residency.index_fill_(0, torch.where(evicted, old, st.num_rows).long(), -1)
        st.owner.index_fill_(0, slots, -1)
        # Newest keys while lent, so that no LRU victim choice could take a buffer slot.
        st.key.index_copy_(0, slots, (st.clock + 1) * S + slots)
        self.buf_slots.copy_(slots.view(self.buffers, self.E))
        self.lent = True
        return evicted.sum().int()

    def _give_back(self) -> None:
        """Return the borrowed slots to the LRU: the streamed experts of the layer each buffer
        holds (the last one copied into it; after a complete forward, the last ``buffers``
        MoE layers) become resident there with a new clock value (most recent); every other
        borrowed slot comes back empty, with a never-used key (first to be taken)."""
        self.lent = False
        if self.on_cuda:  # a copy issued but not computed from: let it land first
            for _, loaded in self.pending.values():
                if loaded is not None:
                    torch.cuda.current_stream().wait_event(loaded)
        st = self.cache.residency
        S, E = st.num_slots, self.E
        st.clock.add_(1)
        for b in range(self.buffers):
            bs = self.buf_slots[b].long()
            h = self.holds.get(b)
            if h is None or self.res_host is None:
                seed = torch.zeros(E, dtype=torch.bool, device=self.device)
            else:
                # Residency is as at the start: nothing in a streamed forward changes it.
                layer_res = st.layer_slots(h, E)
                seed = layer_res < 0
                cpu = self.held_cpu.get(b)
                if cpu is not None:  # the CPU's experts were never copied into the buffer
                    seed &= ~cpu[0]
                flat = torch.arange(h * E, (h + 1) * E, dtype=torch.int32, device=self.device)
                st.owner.index_copy_(0, bs, torch.where(seed, flat, -1))
                layer_res.copy_(torch.where(seed, bs.int(), layer_res))
                self.counts["lru_seeded"] += int(
                    (self.res_host[h * E : (h + 1) * E] < 0).sum()) - (cpu[1] if cpu else 0)
            st.key.index_copy_(0, bs, torch.where(seed, st.clock * S + bs, bs - S))
            # a seeded slot counts as filled now (the useful admission); an empty one as never
            st.filled_at.index_copy_(0, bs, torch.where(seed, st.clock.expand_as(bs),
                                                        torch.full_like(bs, -2)))

    def _issue(self, ordinal: int) -> None:
        """Copy layer ``ordinal``'s non-resident experts into its buffer. While SGLang
        captures graphs (``runtime.capturing``: dummy batches, outputs discarded) nothing is
        copied, or every captured token count would move the whole pool."""
        b = ordinal % self.buffers
        if self.rt.capturing:
            self.pending[ordinal] = (b, None)
            return
        self.holds[b] = ordinal
        self.held_cpu.pop(b, None)
        E = self.E
        missing = (self.res_host[ordinal * E : (ordinal + 1) * E] < 0).tolist()
        c = 0
        if self.cpu_rule is not None and self.rows > 0:
            absent = [e for e in range(E) if missing[e]]
            c = self.cpu_rule.cpu_count(len(absent), self.rows)
            if c:
                on_cpu = absent[len(absent) - c:]
                mask = torch.zeros(E, dtype=torch.bool, pin_memory=self.on_cuda)
                mask[on_cpu] = True
                self.cpu_masks[ordinal] = (mask.to(self.device, non_blocking=True), c)
                self.held_cpu[b] = self.cpu_masks[ordinal]
                for e in on_cpu:
                    missing[e] = False
                self.counts["experts_cpu"] += c
        dst = self.buf_host[b]
        runs = row_runs((ordinal * E + e, dst[e]) for e in range(E) if missing[e])
        streamed = sum(missing)
        reused = E - streamed - c
        loaded = None
        if self.on_cuda:
            loaded = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.free[b])
                started = None
                if self.cpu_rule is not None and streamed:
                    started = torch.cuda.Event(enable_timing=True)
                    started.record(self.copy_stream)
                copy_row_runs(self.pool.banks, self.cache.slot_banks, runs, non_blocking=True)
                loaded.record(self.copy_stream)
                if started is not None:
                    self._copies.append((started, loaded, streamed))
        else:
            t0 = time.perf_counter()
            copy_row_runs(self.pool.banks, self.cache.slot_banks, runs, non_blocking=False)
            self.wait_s += time.perf_counter() - t0  # the compute thread did the copy
        self.pending[ordinal] = (b, loaded)
        self.counts["experts_streamed"] += streamed
        self.counts["experts_reused"] += reused

    # ---- the contract --------------------------------------------------------------------
    def run(self, call: LayerCall) -> torch.Tensor:
        # The tensors go as arguments of their own: a graph break replays the function with
        # its captured tensor arguments (the graph's static buffers).
        return self._run(call.layer, call.ordinal, call.x, call.topk_weights, call.topk_ids, call)

    def _run_eager(self, layer, ordinal, x, topk_weights, topk_ids, call) -> torch.Tensor:
        """The layer call: wait for the layer's copy, compute from its buffer and the LRU
        slots, free the buffer for layer ``ordinal + buffers``. ``x`` and the top-k tensors
        alias ``call``'s."""
        if self.res_host is None:  # not announced by begin_forward (e.g. graph padding)
            self._start()
        if ordinal not in self.pending:
            self._issue(ordinal)
        if self.buffers == 2 and ordinal + 1 < self.L and ordinal + 1 not in self.pending:
            self._issue(ordinal + 1)
        b, loaded = self.pending.pop(ordinal)
        mask, c = self.cpu_masks.pop(ordinal, (None, 0))
        if mask is not None:  # the CPU starts without waiting for the layer's copy
            part = self.cpu_part
            rows = min(self.rows, x.shape[0])
            experts, weights, topk_ids = part.items(
                ordinal, self.E, mask, topk_ids, topk_weights, routed_scale(layer, x))
            part.launch(x, experts, weights, rows, ordinal, c,
                        self.cpu_rule.tokens_per_expert(rows))  # before x may be overwritten
        if loaded is not None:
            reached = torch.cuda.Event(enable_timing=True)
            reached.record()
            torch.cuda.current_stream().wait_event(loaded)
            self._timings.append((reached, loaded))
        layer_res = self.cache.residency.layer_slots(ordinal, self.E)
        slots = torch.where(layer_res >= 0, layer_res, self.buf_slots[b])
        out = run_on_slots(call, topk_ids, slots, self.cache, skip_negative_ids=mask is not None)
        if self.on_cuda:
            self.free[b].record()
        nxt = ordinal + self.buffers
        if nxt < self.L:
            self._issue(nxt)
        if mask is not None:  # the GPU computed its share and streams on meanwhile
            out = self.cpu_part.merge(out, rows)
        self.counts["layer_calls"] += 1
        return out

    # ---- counters ------------------------------------------------------------------------
    def _harvest(self, block: bool) -> None:
        """Add the measured waits of completed layer calls to ``wait_s``: how long the
        compute stream stood at a layer's wait before that layer's copy finished (CUDA
        timing events, read here, off the hot path). On a CPU device ``wait_s`` is the time
        the copies took, since they run in the computing thread."""
        keep = []
        for reached, loaded in self._timings:
            if block or (reached.query() and loaded.query()):
                if block:
                    loaded.synchronize()
                    reached.synchronize()
                self.wait_s += max(0.0, reached.elapsed_time(loaded)) / 1e3
            else:
                keep.append((reached, loaded))
        self._timings = keep
        if self.cpu_rule is not None and self.on_cuda:
            self._calibrate(block)

    def _calibrate(self, block: bool) -> None:
        """Move the CPU share's rule towards the finished copies' and CPU runs' times."""
        copies, keep = [], []
        for started, loaded, n in self._copies:
            if block or loaded.query():
                loaded.synchronize()
                copies.append((started.elapsed_time(loaded) * 1e3, n))
            else:
                keep.append((started, loaded, n))
        self._copies = keep
        self.cpu_part.check()
        runs, self.cpu_part.observed = self.cpu_part.observed, []
        if copies or runs:
            self.cpu_rule = self.cpu_rule.calibrated(copies, runs)
            self.cpu_part.rule = self.cpu_rule

    def snapshot(self) -> Dict[str, float]:
        """Host-side counts of the streamed (full-layer) calls, waits included."""
        self._harvest(block=False)
        return {**self.counts, "wait_s": self.wait_s}

    def reset(self) -> None:
        self._harvest(block=True)
        self.counts = {k: 0 for k in self.counts}
        self.wait_s = 0.0
