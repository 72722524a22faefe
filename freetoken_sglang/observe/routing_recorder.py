"""Records every forward step's routing into a routing-trace file (``--freetoken-record-routing``).

Each MoE layer call copies its top-k ids into one device buffer (a copy that CUDA graphs
capture); after the step, the real tokens' rows are read back and appended to the trace
with the step's phase. Off by default, and then nothing runs: the layer checks one
attribute. The file is rewritten after each of the first ``FLUSH_ALWAYS`` steps, then every
``FLUSH_EVERY`` steps, and at exit.
"""

from __future__ import annotations

import atexit
import logging
from typing import Optional

import torch

from freetoken_sglang.observe.routing_trace import RoutingTraceWriter

logger = logging.getLogger(__name__)

FLUSH_ALWAYS = 1024
FLUSH_EVERY = 256


class RoutingRecorder:
    """Args:
        path: the ``.npz`` to write.
        num_layers, num_experts, top_k: L, E, k.
        device: the serving device.
        max_tokens: the most rows of one forward (the buffer's size).
        meta: trace metadata (model name, ...).
    """

    def __init__(self, path: str, num_layers: int, num_experts: int, top_k: int, device,
                 max_tokens: int, meta: Optional[dict] = None):
        self.writer = RoutingTraceWriter(path, num_layers, num_experts, top_k, meta=meta)
        dtype = torch.int16 if num_experts <= 32767 else torch.int32
        self.buf = torch.zeros(num_layers, max_tokens, top_k, dtype=dtype, device=device)
        self.path = path
        atexit.register(self.close)

    def record_layer(self, ordinal: int, topk_ids: torch.Tensor) -> None:
        """Copy one layer call's ids ``[T, k]`` into the step buffer (no host sync)."""
        self.buf[ordinal, : topk_ids.shape[0]].copy_(topk_ids)

    def end_step(self, phase: str, num_tokens: int) -> None:
        """Append the step just run (``num_tokens`` real rows) to the trace (host sync)."""
        if num_tokens <= 0:
            return
        ids = self.buf[:, :num_tokens].permute(1, 0, 2).cpu().numpy()
        self.writer.add_step(phase, ids)
        n = self.writer.num_steps
        if n <= FLUSH_ALWAYS or n % FLUSH_EVERY == 0:
            self.writer.flush()

    def close(self) -> None:
        if not self.writer._closed:
            self.writer.close()
            logger.info("FreeToken: routing trace of %d steps written to %s",
                        self.writer.num_steps, self.path)
