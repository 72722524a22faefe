"""Routing-trace files: the per-step top-k expert ids of every token at every MoE layer, as a
compact ``.npz`` (writer, reader and schema).

A trace is what an expert-cache replay needs and nothing more: for every forward step (one
batch through the model), whether it was a prefill or a decode step, and for every token of
the step the top-k routed expert ids at each MoE layer. ``benchmarks/replay.py`` replays it
against cache policies (paper §5.3, Fig. 4b).

Schema (format ``freetoken-routing-trace``, version 1), one ``.npz`` (``np.savez_compressed``,
readable with ``np.load(path, allow_pickle=False)``):

    phase       uint8 [steps]            0 = prefill, 1 = decode (``PHASES``)
    num_tokens  int32 [steps]            tokens of each step, >= 1
    ids         int16 [total_tokens, L, k]   (int32 when E > 32767)
                                         local expert ids in [0, E) of each token, MoE
                                         layer and top-k rank, the steps' tokens
                                         concatenated in step order (step s owns rows
                                         sum(num_tokens[:s]) ... sum(num_tokens[:s+1]) - 1)
    meta        str (0-d unicode array)  JSON object:
        format       "freetoken-routing-trace"
        version      1
        num_layers   L: MoE layers, indexed by MoE ordinal (0 = first MoE layer, dense
                     layers are not counted)
        num_experts  E: routed experts per MoE layer (shared experts are not routed, not
                     recorded)
        top_k        k
        model        model name or path, or null
        synthetic    true when the routing was generated, not recorded from a model
        ids_ranked   optional; true when each token's ids run from the highest router
                     weight down (``benchmarks/train_router.py``'s traces are); a replay
                     into a smaller top-k needs it (SGLang's grouped top-k does not sort,
                     so a recorded trace does not claim it)
        ...          free-form notes (e.g. the generator's parameters, the workload)

Conventions: a step's rows are real tokens only (no CUDA-graph padding rows). A batch
mixing prefill and decode tokens is recorded as ``prefill``. Expert ids of one token are
normally distinct; a replay de-duplicates them anyway (per step and layer).
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np

FORMAT = "freetoken-routing-trace"
VERSION = 1
PHASES = ("prefill", "decode")  # index = stored phase code
_PHASE_CODE = {name: code for code, name in enumerate(PHASES)}
_RESERVED = ("format", "version", "num_layers", "num_experts", "top_k")


def _ids_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.int16) if num_experts <= np.iinfo(np.int16).max else np.dtype(np.int32)


def _check_dims(num_layers: int, num_experts: int, top_k: int) -> None:
    for name, v in (("num_layers", num_layers), ("num_experts", num_experts), ("top_k", top_k)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}; pass top_k <= E")


def _check_ids(ids: np.ndarray, num_layers: int, num_experts: int, top_k: int, what: str):
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{what}: ids must be an integer array, got dtype {ids.dtype}")
    if ids.ndim != 3 or ids.shape[1:] != (num_layers, top_k):
        raise ValueError(
            f"{what}: ids must have shape [T, L={num_layers}, k={top_k}], got {tuple(ids.shape)}"
        )
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(
                f"{what}: expert ids must lie in [0, E={num_experts}), got range [{lo}, {hi}]"
                " (strip padding rows / -1 ids before recording)"
            )


class RoutingTrace:
    """An in-memory routing trace (see the module docstring for the schema).

    Build one from arrays, or read a file with ``RoutingTrace.load(path)``.

    Args:
        phase: uint8-compatible [steps], 0 = prefill, 1 = decode.
        num_tokens: int [steps], each >= 1.
        ids: int [total_tokens, L, k] expert ids in [0, E).
        num_experts: E.
        meta: extra JSON-serialisable metadata (``model``, ``synthetic``, notes ...).

    Attributes:
        num_layers, num_experts, top_k: L, E, k.
        phase (uint8 [steps]), num_tokens (int32 [steps]), ids (int16/int32 [N, L, k]),
        step_offsets (int64 [steps + 1]): row range of step s is
        ``step_offsets[s]:step_offsets[s+1]``.
        meta: dict with the schema's keys.
        path: the file it was loaded from, or None.

    Raises:
        ValueError / TypeError on inconsistent shapes, phase codes or ids out of range.
    """

    def __init__(self, phase, num_tokens, ids, num_experts: int, meta: dict | None = None,
                 path: str | None = None):
        ids = np.asarray(ids)
        if ids.ndim != 3:
            raise ValueError(f"ids must have shape [total_tokens, L, k], got {tuple(ids.shape)}")
        num_layers, top_k = int(ids.shape[1]), int(ids.shape[2])
        _check_dims(num_layers, int(num_experts), top_k)
        phase = np.asarray(phase)
        num_tokens = np.asarray(num_tokens)
        if phase.ndim != 1 or num_tokens.shape != phase.shape:
            raise ValueError(
                f"phase and num_tokens must both be 1-D [steps], got {phase.shape} and "
                f"{num_tokens.shape}"
            )
        if phase.size and (phase.min() < 0 or phase.max() >= len(PHASES)):
            raise ValueError(
                f"phase codes must be 0 (prefill) or 1 (decode), got {np.unique(phase)}"
            )
        if num_tokens.size and num_tokens.min() < 1:
            raise ValueError("every step must have num_tokens >= 1 (drop empty steps)")
        if int(num_tokens.sum()) != ids.shape[0]:
            raise ValueError(
                f"sum(num_tokens)={int(num_tokens.sum())} does not match ids rows {ids.shape[0]}"
            )
        _check_ids(ids, num_layers, int(num_experts), top_k, "trace")
        self.num_layers = num_layers
        self.num_experts = int(num_experts)
        self.top_k = top_k
        self.phase = phase.astype(np.uint8)
        self.num_tokens = num_tokens.astype(np.int32)
        self.ids = ids.astype(_ids_dtype(self.num_experts), copy=False)
        self.step_offsets = np.concatenate([[0], np.cumsum(self.num_tokens, dtype=np.int64)])
        m = dict(meta or {})
        for key, want in (("num_layers", num_layers), ("num_experts", self.num_experts),
                          ("top_k", top_k)):
            if key in m and m[key] != want:
                raise ValueError(f"meta[{key!r}]={m[key]!r} contradicts the ids shape ({want})")
        m.update(format=FORMAT, version=VERSION, num_layers=num_layers,
                 num_experts=self.num_experts, top_k=top_k)
        m.setdefault("model", None)
        m.setdefault("synthetic", False)
        self.meta = m
        self.path = path

    # --- queries ---------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return int(self.phase.shape[0])

    @property
    def model(self):
        return self.meta.get("model")

    @property
    def synthetic(self) -> bool:
        return bool(self.meta.get("synthetic", False))

    def __len__(self) -> int:
        return self.num_steps

    def step(self, s: int) -> tuple[str, np.ndarray]:
        """(phase name, ids view [T, L, k]) of step ``s``."""
        a, b = self.step_offsets[s], self.step_offsets[s + 1]
        return PHASES[self.phase[s]], self.ids[a:b]

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        """Steps in order, as (``"prefill"`` | ``"decode"``, ids [T, L, k])."""
        for s in range(self.num_steps):
            yield self.step(s)

    # --- I/O -------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Write the trace to exactly ``path`` (``.npz`` content whatever the suffix; the
        directory must exist)."""
        with open(path, "wb") as f:
            np.savez_compressed(
                f, phase=self.phase, num_tokens=self.num_tokens, ids=self.ids,
                meta=np.array(json.dumps(self.meta, sort_keys=True)),
            )

    @classmethod
    def load(cls, path: str) -> "RoutingTrace":
        """Read a trace file.

        Raises:
            FileNotFoundError if missing; ValueError if it is not a version-1 routing trace
            or its arrays are inconsistent.
        """
        with np.load(path, allow_pickle=False) as z:
            missing = {"phase", "num_tokens", "ids", "meta"} - set(z.files)
            if missing:
                raise ValueError(f"{path}: not a routing trace, missing arrays {sorted(missing)}")
            meta = json.loads(str(z["meta"]))
            phase, num_tokens, ids = z["phase"], z["num_tokens"], z["ids"]
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: meta.format is {meta.get('format')!r}, expected {FORMAT!r}")
        if meta.get("version") != VERSION:
            raise ValueError(
                f"{path}: trace version {meta.get('version')!r}; this reader handles {VERSION}"
            )
        if "num_experts" not in meta:
            raise ValueError(f"{path}: meta lacks num_experts")
        return cls(phase, num_tokens, ids, meta["num_experts"], meta=meta, path=os.fspath(path))


class RoutingTraceWriter:
    """Collects steps in memory and writes one routing-trace ``.npz`` at ``close()``.

    Args:
        path: output file (``.npz``).
        num_layers: L, MoE layers.
        num_experts: E, routed experts per layer.
        top_k: k.
        meta: extra JSON-serialisable metadata (``model``, ``synthetic``, notes); the keys
            format/version/num_layers/num_experts/top_k are set by the writer.

    Use as a context manager (``with RoutingTraceWriter(...) as w: w.add_step(...)``); the
    file is written on a clean exit only.

    Raises:
        ValueError on bad dimensions, reserved or non-JSON metadata.
    """

    def __init__(self, path: str, num_layers: int, num_experts: int, top_k: int,
                 meta: dict | None = None):
        _check_dims(num_layers, num_experts, top_k)
        meta = dict(meta or {})
        bad = [k for k in _RESERVED if k in meta]
        if bad:
            raise ValueError(f"meta keys {bad} are set by the writer; remove them from meta")
        try:
            json.dumps(meta)
        except TypeError as e:
            raise ValueError(f"meta must be JSON-serialisable: {e}") from None
        self.path = os.fspath(path)
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.meta = meta
        self._dtype = _ids_dtype(num_experts)
        self._phase: list[int] = []
        self._ntok: list[int] = []
        self._ids: list[np.ndarray] = []
        self._closed = False

    def add_step(self, phase: str, ids) -> None:
        """Append one forward step.

        Args:
            phase: ``"prefill"`` or ``"decode"``.
            ids: int array (numpy, or a CPU torch tensor) [T, L, k], T >= 1 real tokens,
                expert ids in [0, E). Copied.

        Raises:
            ValueError on an unknown phase, bad shape, T == 0 or ids out of range;
            RuntimeError after ``close()``.
        """
        if self._closed:
            raise RuntimeError("RoutingTraceWriter.add_step after close(); open a new writer")
        if phase not in _PHASE_CODE:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        ids = np.asarray(ids)
        _check_ids(ids, self.num_layers, self.num_experts, self.top_k, "add_step")
        if ids.shape[0] < 1:
            raise ValueError("add_step: a step needs at least one token (T >= 1)")
        self._phase.append(_PHASE_CODE[phase])
        self._ntok.append(int(ids.shape[0]))
        self._ids.append(ids.astype(self._dtype, copy=True))

    @property
    def num_steps(self) -> int:
        return len(self._phase)

    def flush(self) -> None:
        """Write the steps so far (the file is replaced atomically); the writer stays open."""
        if self._closed:
            raise RuntimeError("RoutingTraceWriter.flush after close()")
        self._write(self.path)

    def _write(self, path: str) -> None:
        if self._ids:
            ids = np.concatenate(self._ids, axis=0)
            self._ids = [ids]
        else:
            ids = np.zeros((0, self.num_layers, self.top_k), dtype=self._dtype)
        trace = RoutingTrace(
            np.asarray(self._phase, dtype=np.uint8), np.asarray(self._ntok, dtype=np.int32),
            ids, self.num_experts, meta=self.meta,
        )
        tmp = path + ".tmp.npz"
        trace.save(tmp)
        os.replace(tmp, path)

    def close(self) -> None:
        """Write the file (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        if self._ids:
            ids = np.concatenate(self._ids, axis=0)
        else:
            ids = np.zeros((0, self.num_layers, self.top_k), dtype=self._dtype)
        trace = RoutingTrace(
            np.asarray(self._phase, dtype=np.uint8), np.asarray(self._ntok, dtype=np.int32),
            ids, self.num_experts, meta=self.meta,
        )
        trace.save(self.path)
        self._ids.clear()

    def __enter__(self) -> "RoutingTraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True  # do not write a partial trace after an error
