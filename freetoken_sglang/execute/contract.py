"""The executor contract: one MoE layer call in, its routed-expert output out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class LayerCall:
    """One MoE layer call.

    Attributes:
        layer: SGLang's ``FusedMoE`` (its ``moe_runner_config`` and ``[E, ...]`` host-pool
            parameters).
        ordinal: the layer's MoE ordinal ``l``.
        x: ``[T, H]`` activations (rows past ``runtime.num_valid`` are graph padding).
        topk_weights: fp32 ``[T, k]`` router weights.
        topk_ids: int ``[T, k]`` local expert ids.
        topk_output: SGLang's ``StandardTopKOutput`` the ids and weights come from.
    """

    layer: torch.nn.Module
    ordinal: int
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    topk_output: object

    @property
    def rows(self) -> int:
        return self.x.shape[0]


class Executor(Protocol):
    """Serves layer calls: ``run`` returns the routed-expert output ``[T, H]`` in the layer's
    dtype, scaled as SGLang's own runner scales it on that device (``routed_scaling_factor``
    inside the Triton runner on CUDA; left to the model by the native CPU MoE)."""

    name: str

    def run(self, call: LayerCall) -> torch.Tensor: ...
