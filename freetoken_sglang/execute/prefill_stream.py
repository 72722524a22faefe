"""The prefill-stream executor: whole layers stream over PCIe into full-layer buffers,
double-buffered, while the previous layer computes; the LRU is not touched (paper §3.1)."""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch

from freetoken_sglang.cache.fills import contiguous_runs, copy_row_runs
from freetoken_sglang.execute.contract import LayerCall
from freetoken_sglang.execute.slot_moe import run_on_slots


class PrefillStreamExecutor:
    """Serves each layer call of a streamed forward from a full-layer buffer.

    Layer ``l`` goes to buffer ``l % buffers``. With two buffers, the copy of layer ``l + 2``
    into a buffer starts as soon as layer ``l`` has computed from it, so one layer's transfer
    always overlaps the computation before it; with one buffer, each copy waits for the
    previous layer's compute (the no-overlap baseline). The first ``buffers`` layers are
    issued when the forward starts (``begin_forward``), before layer 0's attention runs.

    Experts resident in the LRU when the forward starts are not sent: the call reads them
    from their slots (``experts_reused``). Only the non-resident rows of the layer are copied,
    one ``cudaMemcpyAsync`` per contiguous run and bank on a dedicated copy stream, from the
    pinned pool (the copy engine; no SM is taken from the compute). Nothing of the LRU is
    read-modified: no eviction, no recency change. The residency table is read to the host
    once per streamed forward (one sync); it cannot change during that forward, since every
    layer call of it streams.

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
        self.device = cache.device
        self.on_cuda = self.device.type == "cuda"
        self.arange = torch.arange(self.E, dtype=torch.int32, device=self.device)
        self.pending: Dict[int, Tuple[int, Optional[torch.cuda.Event]]] = {}
        self.res_host: Optional[torch.Tensor] = None
        self.counts = dict(layer_calls=0, experts_streamed=0, experts_reused=0)
        self.wait_s = 0.0
        self._timings: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []
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
    def begin_forward(self, prefetch: bool) -> None:
        """Start of a forward: forget the previous forward's buffers; when ``prefetch``
        (the forward will stream), read the residency table and issue the first layers."""
        self.pending.clear()
        self.res_host = None
        self._harvest(block=False)
        if prefetch:
            self._snapshot()
            for ordinal in range(min(self.buffers, self.L)):
                self._issue(ordinal)

    def end_forward(self) -> None:
        """End of a forward: its snapshot and buffers are no longer valid."""
        self.pending.clear()
        self.res_host = None

    def _snapshot(self) -> None:
        """Read the residency table (a sync), and order this forward's copies after every
        kernel queued so far (a decode wave may have used the buffer rows)."""
        self.res_host = self.cache.residency.residency[: self.L * self.E].cpu()
        if self.on_cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream())

    def _issue(self, ordinal: int) -> None:
        """Copy layer ``ordinal``'s non-resident experts into its buffer. While SGLang
        captures graphs (``runtime.capturing``: dummy batches, outputs discarded) nothing is
        copied, or every captured token count would move the whole pool."""
        b = ordinal % self.buffers
        if self.rt.capturing:
            self.pending[ordinal] = (b, None)
            return
        base = self.layout.buffer_base(b, self.E)
        res = self.res_host[ordinal * self.E : (ordinal + 1) * self.E]
        missing = (res < 0).tolist()
        runs = [
            (ordinal * self.E + e0, base + e0, n) for e0, n in contiguous_runs(missing)
        ]
        streamed = sum(missing)
        loaded = None
        if self.on_cuda:
            loaded = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.free[b])
                copy_row_runs(self.pool.banks, self.cache.slot_banks, runs, non_blocking=True)
                loaded.record(self.copy_stream)
        else:
            t0 = time.perf_counter()
            copy_row_runs(self.pool.banks, self.cache.slot_banks, runs, non_blocking=False)
            self.wait_s += time.perf_counter() - t0  # the compute thread did the copy
        self.pending[ordinal] = (b, loaded)
        self.counts["experts_streamed"] += streamed
        self.counts["experts_reused"] += self.E - streamed

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
            self._snapshot()
        if ordinal not in self.pending:
            self._issue(ordinal)
        if self.buffers == 2 and ordinal + 1 < self.L and ordinal + 1 not in self.pending:
            self._issue(ordinal + 1)
        b, loaded = self.pending.pop(ordinal)
        if loaded is not None:
            reached = torch.cuda.Event(enable_timing=True)
            reached.record()
            torch.cuda.current_stream().wait_event(loaded)
            self._timings.append((reached, loaded))
        base = self.layout.buffer_base(b, self.E)
        layer_res = self.cache.residency.layer_slots(ordinal, self.E)
        slots = torch.where(layer_res >= 0, layer_res, self.arange + base)
        out = run_on_slots(call, topk_ids, slots, self.cache)
        if self.on_cuda:
            self.free[b].record()
        nxt = ordinal + self.buffers
        if nxt < self.L:
            self._issue(nxt)
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

    def snapshot(self) -> Dict[str, float]:
        """Host-side counts of the streamed (full-layer) calls, waits included."""
        self._harvest(block=False)
        return {**self.counts, "wait_s": self.wait_s}

    def reset(self) -> None:
        self._harvest(block=True)
        self.counts = {k: 0 for k in self.counts}
        self.wait_s = 0.0
