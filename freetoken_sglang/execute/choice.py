"""Which executor serves a layer call: the streaming crossover rule and the choice from shapes.

The choice depends only on the call's row count, the forward's phase and the slot layout, so
a captured CUDA graph keeps the executor it was captured with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from freetoken_sglang.cache.layout import RESIDENT, STREAM
from freetoken_sglang.cache.residency import max_unique_experts

# Stream a prefill layer call once its rows are expected to route to at least this fraction
# of the layer's experts. Streaming moves the non-resident part of the whole layer, hidden
# behind compute; on demand, the LRU path moves the call's distinct misses, one layer after
# another, and evicts the decode working set. Measured on the H200 (Qwen3-30B-A3B shape,
# 25% cache; benchmarks/RESULTS.md, session 6, bench_prefill.py's short prompts): a streamed
# forward took 0.84-0.86 s at 64-512 rows; the LRU path 0.78 s at 16 rows (64% of the experts
# expected) and 1.03 s at 32 rows (87%); interpolated, they cross near 21 rows (73%). Measured
# for that shape and link only.
STREAM_MIN_EXPERT_FRACTION = 0.75

DECODE, EXTEND = "decode", "extend"


def expected_distinct_experts(rows: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts of ``rows`` tokens routed uniformly, k distinct each:
    ``E * (1 - (1 - k/E)^rows)``."""
    if rows <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def stream_min_rows(
    num_experts: int, top_k: int, fraction: float = STREAM_MIN_EXPERT_FRACTION
) -> int:
    """The fewest rows whose expected distinct experts reach ``fraction * E``.

    Raises:
        ValueError: fraction outside (0, 1), or top_k outside [1, E].
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if top_k == num_experts:
        return 1
    rows = math.ceil(math.log(1.0 - fraction) / math.log(1.0 - top_k / num_experts))
    # Guard against rounding at the boundary.
    target = fraction * num_experts
    while rows > 1 and expected_distinct_experts(rows - 1, num_experts, top_k) >= target:
        rows -= 1
    return max(1, rows)


@dataclass(frozen=True)
class ExecutorChoice:
    """The inputs of the choice that are fixed at start.

    Attributes:
        backend: ``gpu`` or ``cpu`` (every routed expert on the CPU executor).
        layout_kind: the slot layout (``cache/layout.py``).
        lru_slots: slots the LRU manages.
        num_experts: E.
        top_k: k.
        stream_min_rows: prefill layer calls of at least this many rows stream.
        prefill: ``stream`` (default) or ``lru`` (prefill goes through the decode LRU).
    """

    backend: str
    layout_kind: str
    lru_slots: int
    num_experts: int
    top_k: int
    stream_min_rows: int
    prefill: str = "stream"

    def executor_for(self, rows: int, phase: str) -> str:
        """``decode`` (the LRU path), ``stream``, ``waves``, ``resident`` or ``cpu`` for a layer
        call over ``rows`` rows in a forward of ``phase`` (``decode`` or ``extend``).

        - ``cpu`` backend: always ``cpu``. Every expert resident: always ``resident`` (stock
          SGLang's MoE over the layer's slots).
        - An extend forward (prefill chunks, and batches that mix prefill and decode rows)
          at or above ``stream_min_rows`` rows streams; the executor reads each row's own
          routing, so mixed rows are served exactly.
        - Otherwise the LRU path when the call's most distinct experts fit the LRU;
        - else ``stream`` in an extend forward with full-layer buffers, ``waves`` otherwise
          (waves are device-planned, so decode CUDA graphs capture them).
        """
        if self.backend == "cpu":
            return "cpu"
        if self.layout_kind == RESIDENT:
            return "resident"
        streaming = phase == EXTEND and self.prefill == "stream"
        if streaming and rows >= self.stream_min_rows:
            return "stream" if self.layout_kind == STREAM else "waves"
        if max_unique_experts(rows, self.top_k, self.num_experts) <= self.lru_slots:
            return "decode"
        if phase == EXTEND and self.layout_kind == STREAM:
            return "stream"
        return "waves"


# SGLang 0.5.17 reserves about this much GPU memory per prefill-chunk token for activations
# (``ServerArgs._handle_gpu_memory_settings``: 512 MiB + 1.5 MiB x chunk tokens).
SGLANG_MIB_PER_CHUNK_TOKEN = 1.5
SGLANG_RESERVE_BASE_MIB = 512
# Under streaming, the share of GPU memory a prefill chunk's activations may take; the routed
# experts are off the GPU, which is what leaves room for a larger chunk than stock's.
CHUNK_MEMORY_SHARE = 0.25
CHUNK_MIN, CHUNK_MAX = 2048, 32768


def choose_chunked_prefill_size(gpu_mem_mib: float, context_len: int = 0) -> int:
    """The prefill chunk when the user sets none: every streamed chunk costs about one pass
    of the pool over PCIe, so the largest power of two whose activation reserve (SGLang's
    own estimate) fits ``CHUNK_MEMORY_SHARE`` of the GPU memory, within
    ``[CHUNK_MIN, CHUNK_MAX]``, and no larger than the context (rounded up to a power of two).

    Args:
        gpu_mem_mib: GPU memory capacity in MiB.
        context_len: the model's context length in tokens (0: unknown).
    """
    budget = gpu_mem_mib * CHUNK_MEMORY_SHARE - SGLANG_RESERVE_BASE_MIB
    chunk = CHUNK_MIN
    while chunk * 2 <= CHUNK_MAX and (chunk * 2) * SGLANG_MIB_PER_CHUNK_TOKEN <= budget:
        chunk *= 2
    if context_len > 0:
        cap = CHUNK_MIN
        while cap < context_len:
            cap *= 2
        chunk = min(chunk, cap)
    return chunk
