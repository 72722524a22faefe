"""Benchmark-only routing replay (``--freetoken-replay-routing``): every MoE layer call routes to a recorded trace's top-k ids instead of its router's, so that dummy-weight benchmarks see a trained model's routing.

The trace's token rows (``observe/routing_trace.py``; all rows, or only its decode rows) are
consumed in order by the forwards, cycling at the end: a forward of ``T`` real rows takes the
next ``T`` rows, the same rows for every MoE layer. MoE layer ``l`` of ``L`` reads trace layer
``l * L_trace // L`` (layers spread evenly); the number of experts must be the model's, and a
trace of a larger top-k whose ids are in rank order (meta ``ids_ranked``, or written by
``benchmarks/train_router.py``, whose top-k is sorted) replays each token's first ``k`` ids,
the same router's top-``k`` (e.g. the trained top-8 trace into GPT-OSS's top-4). The
router's weights are kept (they then belong to other experts: outputs are not the model's). The ids are gathered on the device from a device cursor, so CUDA graphs capture
the replay; off, nothing runs (one attribute check per layer call).
"""

from __future__ import annotations

from typing import List

import numpy as np
import torch

from freetoken_sglang.errors import RefusedError
from freetoken_sglang.observe.routing_trace import RoutingTrace


def layer_map(trace_layers: int, model_layers: int) -> List[int]:
    """Trace layer of each of the model's MoE layers: ``l * trace_layers // model_layers``."""
    return [l * trace_layers // model_layers for l in range(model_layers)]


def ranked(meta: dict) -> bool:
    """Whether a trace's ids run from the highest router weight down (meta ``ids_ranked``;
    ``benchmarks/train_router.py`` sorts its top-k, also in traces written before the key)."""
    return bool(meta.get("ids_ranked")) or meta.get("generator") == "benchmarks/train_router.py"


class RoutingReplay:
    """Args:
        path: the trace (``.npz``).
        num_layers, num_experts, top_k: the model's MoE layers L, experts E and k.
        device: the serving device.
        phase: ``all`` (every row in order) or ``decode`` (the decode steps' rows only).

    Raises:
        RefusedError: the file is not a routing trace, its E differs from the model's, its k
            is smaller than the model's, or larger without ids in rank order, or it has no
            row of the phase asked for.
    """

    def __init__(self, path: str, num_layers: int, num_experts: int, top_k: int, device,
                 phase: str = "all"):
        try:
            trace = RoutingTrace.load(path)
        except (OSError, ValueError, TypeError) as e:
            raise RefusedError(f"--freetoken-replay-routing {path}: {e}") from e
        if trace.num_experts != num_experts or trace.top_k < top_k:
            raise RefusedError(
                f"--freetoken-replay-routing {path}: the trace routes top-{trace.top_k} of "
                f"{trace.num_experts} experts, the model top-{top_k} of {num_experts}; record "
                "or train the trace with the model's experts and at least its top-k"
            )
        if trace.top_k > top_k and not ranked(trace.meta):
            raise RefusedError(
                f"--freetoken-replay-routing {path}: the trace routes top-{trace.top_k}, the "
                f"model top-{top_k}, and its ids are not marked as in rank order (meta "
                f"ids_ranked), so its top-{top_k} is unknown; record or train the trace with "
                "the model's top-k"
            )
        ids = trace.ids[..., :top_k]  # the k highest-ranked ids of a larger top-k
        self.trace_top_k = int(trace.top_k)
        if phase == "decode":
            keep = np.repeat(trace.phase == 1, trace.num_tokens)
            ids = ids[keep]
        if not ids.shape[0]:
            raise RefusedError(f"--freetoken-replay-routing {path}: no {phase} rows")
        self.path = path
        self.phase = phase
        self.meta = dict(trace.meta)
        self.trace_layers = trace.num_layers
        self.layers = layer_map(trace.num_layers, num_layers)
        self.num_rows = int(ids.shape[0])
        # [L_trace, R, k]: one contiguous table per trace layer
        self.table = torch.from_numpy(np.ascontiguousarray(ids.transpose(1, 0, 2))).to(
            device=device, dtype=torch.int32)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)
        self.rows_used = 0  # host count of the rows consumed (stats)
        self._gathered = None  # [L_trace, T, k] ids of the forward in progress

    def ids_for(self, ordinal: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """The replayed ids ``[T, k]`` (dtype of ``topk_ids``) of MoE layer ``ordinal`` for
        a call shaped like ``topk_ids``: rows ``cursor .. cursor + T - 1`` (cyclic)."""
        t = topk_ids.shape[0]
        g = self._gathered
        if ordinal == 0 or g is None or g.shape[1] != t or g.dtype != topk_ids.dtype:
            # once per forward (at its first MoE layer): every trace layer's rows, so that
            # the other layers take a view and launch nothing
            rows = torch.remainder(
                self.cursor + torch.arange(t, device=topk_ids.device), self.num_rows)
            table = self.table if self.table.dtype == topk_ids.dtype else self.table.to(
                topk_ids.dtype)
            self.table = table
            g = self._gathered = table.index_select(1, rows)
        return g[self.layers[ordinal]]

    def advance(self, num_tokens: int) -> None:
        """After a forward of ``num_tokens`` real rows (no host sync)."""
        self.cursor.add_(num_tokens)
        self._gathered = None  # the next forward gathers its own rows
        self.rows_used += num_tokens

    def reset(self) -> None:
        """Back to the first row (after CUDA-graph capture ran dummy batches)."""
        self.cursor.zero_()
        self.rows_used = 0

    def rewind(self) -> None:
        """Back to the first row, ``rows_used`` kept (after a resize or a policy change: every
        cache size and policy of a benchmark matrix then replays the same rows)."""
        self.cursor.zero_()
        self._gathered = None

    def describe(self) -> str:
        what = "synthetic routing" if self.meta.get("synthetic") else (
            f"the routing of {self.meta.get('model') or 'an unnamed model'}")
        note = self.meta.get("note") or self.meta.get("small_model")
        return (
            f"ROUTING REPLAYED (benchmark only; outputs are not the model's): {self.num_rows} "
            f"{self.phase} rows of {self.path} ({what}{'; ' + str(note) if note else ''}), "
            f"trace layers {self.layers} for the model's MoE layers"
            + (f"; each token's {self.table.shape[2]} highest-ranked of the trace's "
               f"top-{self.trace_top_k}" if self.trace_top_k > self.table.shape[2] else "")
        )

    def snapshot(self) -> dict:
        return {"path": self.path, "phase": self.phase, "rows": self.num_rows,
                "rows_used": self.rows_used, "layer_map": self.layers,
                "trace_top_k": self.trace_top_k, "top_k": int(self.table.shape[2]),
                "synthetic": bool(self.meta.get("synthetic")), "model": self.meta.get("model")}
