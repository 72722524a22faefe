"""Anchor states taken inside a prefill forward, so that no chunk ends at an anchor.

For each request of an extend with anchors strictly inside it, a mamba slot per anchor is
reserved before the forward (``reserve``). Each gated-DeltaNet layer call then runs as stock
SGLang runs it, and afterwards replays the request's pre-convolution inputs segment by
segment, from its initial state up to each anchor, through the same backend call
(``GDNAttnBackend.forward_extend`` on a one-sequence view), leaving the state at each anchor
in its slot (``replay``). When SGLang next caches the request (``cache_unfinished_req``),
each anchor state is inserted as if a chunk had ended there (``insert``). Only the recurrent
layers run twice, over the tokens up to the last anchor; the MoE layers and the expert stream
run once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch

# Request attribute: the Snapshots reserved for its extend in flight.
SNAP_ATTR = "_freetoken_anchor_snaps"


@dataclass
class Snapshots:
    """The anchor states one request takes in one extend.

    ``row``: its first row in the forward's extend rows; ``start``: its extend's first token
    position (the matched prefix); ``positions``: anchor positions in ``(start, end)``;
    ``slots``: ``[len(positions)]`` mamba slots (the allocator's ids) and ``phys`` the same
    as indices of the state tensors; ``req_slot``: ``[1]`` the request's own slot (state
    index); ``layers``: the recurrent layers that replayed (all of them, or the states are not
    used).
    """

    row: int
    start: int
    positions: Tuple[int, ...]
    slots: torch.Tensor
    phys: torch.Tensor
    req_slot: torch.Tensor
    layers: set = field(default_factory=set)
    views: list = field(default_factory=list)  # per segment (metadata, batch view), built once


def reserve(batch, req_to_token_pool, tree_cache, anchors) -> List[Snapshots]:
    """Before an extend forward: a mamba slot per anchor strictly inside each request's
    extend (its plan's cuts; the deepest ``anchors.states.budget`` of them), attached to the
    request. A request whose slots cannot be had, with one more for the tree's copy, even
    after evicting unpinned states, takes none (nothing is evicted for it then); counted in
    ``anchors.states.missed``.

    Args:
        batch: SGLang's ``ScheduleBatch`` (extend, not mixed with decode).
        req_to_token_pool: the ``HybridReqToTokenPool`` (its ``mamba_allocator``).
        tree_cache: the ``UnifiedRadixCache`` (evicted for slots when needed).
        anchors: the process's ``anchors.book.Anchors``.
    """
    from freetoken_sglang.anchors.book import PLAN_ATTR

    out, row = [], 0
    for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        start, n = int(start), int(n)
        plan = getattr(req, PLAN_ATTR, None)
        pos = tuple(p for p in (plan.cuts if plan is not None else ()) if start < p < start + n)
        old = getattr(req, SNAP_ATTR, None)
        if old is not None:  # a previous extend's states never inserted
            release(req, req_to_token_pool, anchors)
        if len(pos) > anchors.states.budget:
            anchors.states.missed += len(pos) - anchors.states.budget
            pos = pos[len(pos) - anchors.states.budget:]
        if pos:
            slots = _alloc(req_to_token_pool, tree_cache, len(pos))
            if slots is None:
                anchors.states.missed += len(pos)
            else:
                translate = getattr(req_to_token_pool, "translate_mamba_indices", lambda i: i)
                snap = Snapshots(row, start, pos, slots, translate(slots).to(torch.int64),
                                 translate(req.mamba_pool_idx.view(1)).to(torch.int64))
                setattr(req, SNAP_ATTR, snap)
                out.append(snap)
        row += n
    return out


def _alloc(pool, tree_cache, n: int) -> Optional[torch.Tensor]:
    """``n`` slots, keeping one more free for the tree's copy of the first state; evicts
    unpinned states only when that is enough (None otherwise)."""
    free = pool.mamba_allocator.available_size()
    if free < n + 1:
        if free + tree_cache.mamba_evictable_size() < n + 1:
            return None
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        tree_cache.evict(EvictParams(num_tokens=0, mamba_num=n + 1 - free))
        if pool.mamba_allocator.available_size() < n + 1:
            return None
    return pool.mamba_allocator.alloc(n)


def replay(backend, original, layer, forward_batch, mixed_qkv, a, b, snaps, kwargs):
    """One recurrent layer's extend with anchor states: the stock call, then per request the
    segments from its initial state to each anchor replayed into the anchor's slot.

    Args:
        backend: the ``GDNAttnBackend``; ``original`` its unwrapped ``forward_extend``.
        mixed_qkv: ``[T, D]`` pre-convolution inputs; ``a``, ``b``: ``[T, H]`` gate inputs.
        snaps: the forward's ``Snapshots``.

    Returns:
        The stock call's output, unchanged.
    """
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    states = (cache.conv[0], cache.temporal)
    saved = []
    with torch.no_grad():
        for s in snaps:
            last = s.positions[-1] - s.start
            rows = slice(s.row, s.row + last)
            # the inputs and the initial state, before the stock call updates them in place
            saved.append((mixed_qkv[rows].clone(), a[rows].clone(), b[rows].clone()))
            first = s.phys[:1]
            for t in states:
                if s.start > 0:
                    t[first] = t[s.req_slot]
                else:
                    t[first] = 0
    out = original(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    meta = backend.forward_metadata
    try:
        with torch.no_grad():
            for s, (x, aa, bb) in zip(snaps, saved):
                if not s.views:  # the same for every layer of this forward
                    done = s.start
                    for i, p in enumerate(s.positions):
                        view = SimpleNamespace(
                            forward_mode=forward_batch.forward_mode,
                            extend_prefix_lens=torch.tensor([done], device=mixed_qkv.device),
                            extend_seq_lens_cpu=[p - done],
                        )
                        s.views.append((_one_sequence(meta, p - done, s.phys[i:i + 1]), view))
                        done = p
                done = s.start
                for i, p in enumerate(s.positions):
                    if i > 0:
                        for t in states:
                            t[s.phys[i:i + 1]] = t[s.phys[i - 1:i]]
                    lo, hi = done - s.start, p - s.start
                    backend.forward_metadata, view = s.views[i]
                    original(backend, layer, view, x[lo:hi], aa[lo:hi], bb[lo:hi], **kwargs)
                    done = p
                s.layers.add(layer.layer_id)
    finally:
        backend.forward_metadata = meta
    return out


def _one_sequence(meta, n: int, slot: torch.Tensor):
    """The backend's forward metadata for one sequence of ``n`` tokens in ``slot``, with no
    state tracking of SGLang's own."""
    one = copy.copy(meta)
    one.query_start_loc = torch.tensor([0, n], dtype=meta.query_start_loc.dtype,
                                       device=meta.query_start_loc.device)
    one.mamba_cache_indices = slot.to(dtype=meta.mamba_cache_indices.dtype,
                                      device=meta.mamba_cache_indices.device)
    one.has_mamba_track_mask = False
    if hasattr(one, "state_checkpoint_cu_starts"):
        one.state_checkpoint_cu_starts = None
        one.num_state_checkpoints = 0
    return one


def insert(tree_cache, original, req, linear_layers: int, anchors, pin: bool = True) -> None:
    """Before SGLang caches ``req``'s extend: each anchor state it took enters the radix tree
    as if a chunk had ended there (``original``: the unwrapped ``cache_unfinished_req``, run
    with the request's fill ending at the anchor and its state slot swapped for the anchor's;
    the tree copies the state into a slot of its own). States are used only if every one of
    the ``linear_layers`` recurrent layers replayed them (a captured graph would skip the
    replay). Each reserved slot is freed once the tree holds its copy. ``pin``: pin each
    inserted node that the request's plan keeps (False when ``original`` pins itself)."""
    snap = getattr(req, SNAP_ATTR, None)
    if snap is None:
        return
    delattr(req, SNAP_ATTR)
    free = tree_cache.req_to_token_pool.mamba_allocator.free
    if len(snap.layers) != linear_layers:
        anchors.states.missed += len(snap.positions)
        free(snap.slots)
        return
    extend, own = req.extend_range, req.mamba_pool_idx
    freed = 0  # slots[:freed] are back in the allocator
    try:
        for i, p in enumerate(snap.positions):
            req.extend_range = extend._replace(end=p)
            req.mamba_pool_idx = snap.slots[i].to(own.dtype)
            original(tree_cache, req, chunked=True)
            req.mamba_pool_idx = own
            free(snap.slots[i:i + 1])  # the tree holds its own copy now
            freed = i + 1
            anchors.states.snapped += 1
            if pin:
                anchors.keep_if_planned(req, p)
    finally:
        req.extend_range, req.mamba_pool_idx = extend, own
        if freed < len(snap.positions):
            free(snap.slots[freed:])


def release(req, pool, anchors) -> None:
    """Free the slots of anchor states ``req`` took but will not insert; counted missed."""
    snap = getattr(req, SNAP_ATTR, None)
    if snap is not None:
        delattr(req, SNAP_ATTR)
        pool.mamba_allocator.free(snap.slots)
        anchors.states.missed += len(snap.positions)
