"""Anchor states taken inside a prefill forward, so that no chunk ends at an anchor.

For each request of an extend with anchors strictly inside it, a mamba slot per anchor is
reserved before the forward (``reserve``). Each gated-DeltaNet layer call then runs as stock
SGLang runs it and afterwards leaves the state at each anchor in its slot (``replay``): from
the chunk-start states the stock call's chunked kernel computes anyway (``h``: the state at
every 64th token, as SGLang's own ``extra_buffer`` tracking reads them), each anchor's state
is its chunk's start state advanced over the anchor's offset in the chunk, all anchors of a
request in one batched backend call per layer (``GDNAttnBackend.forward_extend`` on a view of
one sequence per anchor). ``h`` is in the activations' dtype (BF16 on a GPU; SGLang's
``chunk_gated_delta_rule_fwd_h``) where the recurrent state is FP32, so a state from it is
rounded once to BF16 at its chunk start, as the states of SGLang's own ``extra_buffer``
tracking are. Where the kernel returns no ``h`` (SGLang's CPU kernels, and FlashInfer's or the
CuTe DSL prefill kernels when no checkpoint is asked for) or the forward asked for state
checkpoints (whose ``h`` means something else), the inputs are replayed segment by segment,
from the initial state up to each anchor, one call per anchor, in FP32; the first such
forward logs it once.
When SGLang next caches the request (``cache_unfinished_req``), each anchor state is inserted
as if a chunk had ended there (``insert``). The MoE layers and the expert stream run once.
"""

from __future__ import annotations

import copy
import itertools
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)
_said_segments = False  # the segment replay's reason is logged once per process

# Request attribute: the Snapshots reserved for its extend in flight.
SNAP_ATTR = "_freetoken_anchor_snaps"


@dataclass
class Snapshots:
    """The anchor states one request takes in one extend.

    ``row``: its first row in the forward's extend rows; ``start``: its extend's first token
    position (the matched prefix); ``positions``: anchor positions in ``(start, end)``;
    ``slots``: ``[len(positions)]`` mamba slots (the allocator's ids) and ``phys`` the same
    as indices of the state tensors; ``req_slot``: ``[1]`` the request's own slot (state
    index); ``layers``: the recurrent layers that wrote the states (all of them, or the
    states are not used); ``built``: what ``replay`` computes once per forward and reuses in
    every layer (index tensors and batch views, under ``"chunks"`` or ``"segments"``, the
    path taken).
    """

    row: int
    start: int
    positions: Tuple[int, ...]
    slots: torch.Tensor
    phys: torch.Tensor
    req_slot: torch.Tensor
    layers: set = field(default_factory=set)
    built: dict = field(default_factory=dict)  # per forward: index tensors and views


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


# Tokens per chunk of SGLang's chunked gated-delta kernel
# (sglang.kernels.ops.attention.fla.chunk.CHUNK_SIZE): ``h`` holds each chunk's start state.
CHUNK = 64


def replay(backend, original, layer, forward_batch, mixed_qkv, a, b, snaps, kwargs):
    """One recurrent layer's extend with anchor states: the stock call, then each request's
    anchor states written into the anchors' slots (from the chunk-start states where the
    kernel returns them, else by replaying each segment).

    Args:
        backend: the ``GDNAttnBackend``; ``original`` its unwrapped ``forward_extend``.
        mixed_qkv: ``[T, D]`` pre-convolution inputs; ``a``, ``b``: ``[T, H]`` gate inputs.
        snaps: the forward's ``Snapshots``.

    Returns:
        The stock call's output, unchanged.
    """
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    conv, ssm = cache.conv[0], cache.temporal
    saved = []
    with torch.no_grad():
        for s in snaps:
            rows = slice(s.row, s.row + s.positions[-1] - s.start)
            # the inputs and the initial states, before the stock call updates them in place
            init = tuple(t[s.req_slot].clone() if s.start > 0 else
                         torch.zeros_like(t[s.req_slot]) for t in (conv, ssm))
            saved.append((mixed_qkv[rows].clone(), a[rows].clone(), b[rows].clone(), init))
    meta = backend.forward_metadata
    out, h = _stock_call_keeping_h(backend, original, layer, forward_batch, mixed_qkv, a, b,
                                   kwargs)
    offsets, why = _h_offsets(forward_batch, meta, h, ssm)
    if offsets is None:
        _say_segments(why)
    try:
        with torch.no_grad():
            for s, (x, aa, bb, init) in zip(snaps, saved):
                if offsets is not None and s.row in offsets:
                    _from_chunks(backend, original, layer, forward_batch, meta, s, x, aa, bb,
                                 init, h, offsets[s.row], conv, ssm, kwargs)
                else:
                    _by_segments(backend, original, layer, forward_batch, meta, s, x, aa, bb,
                                 init, conv, ssm, kwargs)
                s.layers.add(layer.layer_id)
    finally:
        backend.forward_metadata = meta
    return out


def _stock_call_keeping_h(backend, original, layer, forward_batch, mixed_qkv, a, b, kwargs):
    """The stock call, and the chunk-start states ``h`` ``[1, chunks, HV, V, K]`` its kernel
    dispatcher's ``extend`` returned (None where it returned none)."""
    disp = getattr(backend, "kernel_dispatcher", None)
    if disp is None or not hasattr(disp, "extend"):
        return original(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs), None
    box = {}
    own = vars(disp).get("extend")
    inner = disp.extend

    def extend(*args, **kw):
        res = inner(*args, **kw)
        box["h"] = res[2] if isinstance(res, tuple) and len(res) == 3 else None
        return res

    disp.extend = extend
    try:
        out = original(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    finally:
        if own is None:
            del disp.extend
        else:
            disp.extend = own
    return out, box.get("h")


def _h_offsets(forward_batch, meta, h, ssm) -> Tuple[Optional[dict], str]:
    """``{first extend row of a sequence: its first chunk in h}`` when ``h`` holds the state
    at the start of every ``CHUNK`` tokens of every sequence, each shaped as a slot of
    ``ssm``; else None and why."""
    if not isinstance(h, torch.Tensor):
        return None, "the prefill kernel returns no chunk-start states"
    if getattr(meta, "num_state_checkpoints", 0):  # FlashInfer's h: states after checkpoints
        return None, "the forward asked for state checkpoints"
    lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
    if h.dim() != 5 or h.shape[0] != 1 or h.shape[2:] != ssm.shape[1:] or lens is None:
        return None, f"the prefill kernel's states have an unknown layout {tuple(h.shape)}"
    out, row, chunk = {}, 0, 0
    for n in (int(n) for n in lens):
        out[row] = chunk
        row, chunk = row + n, chunk + ((n - 1) // CHUNK + 1 if n > 0 else 0)
    if chunk != h.shape[1]:
        return None, f"the prefill kernel returned {h.shape[1]} chunk states, not {chunk}"
    return out, ""


def _say_segments(why: str) -> None:
    global _said_segments
    if not _said_segments:
        _said_segments = True
        logger.info("FreeToken anchors: states inside the forward replay one segment per "
                    "anchor (%s); snapped_from_chunks in /freetoken/stats stays 0", why)


def _from_chunks(backend, original, layer, forward_batch, meta, s, x, aa, bb, init, h, first,
                 conv, ssm, kwargs):
    """Each anchor's state from its chunk's start state (``h``, or the initial state for the
    first chunk) and conv window (the ``W`` inputs before the chunk), advanced over the
    anchor's offset in the chunk by one backend call over every anchor with an offset."""
    if "chunks" not in s.built:  # the same for every layer of this forward
        rel = [p - s.start for p in s.positions]
        c = [r // CHUNK for r in rel]
        dev = x.device
        # the window before chunk start q: inputs q - W .. q - 1 of [initial window, x]
        win = torch.tensor([[CHUNK * ci + k for k in range(conv.shape[-1])] for ci in c],
                           device=dev)
        sel = [i for i, r in enumerate(rel) if r % CHUNK]
        seg = None
        if sel:
            lens = [rel[i] % CHUNK for i in sel]
            rows = torch.cat([torch.arange(CHUNK * c[i], rel[i]) for i in sel]).to(dev)
            view = SimpleNamespace(
                forward_mode=forward_batch.forward_mode,
                extend_prefix_lens=torch.ones(len(sel), dtype=torch.int64, device=dev),
                extend_seq_lens_cpu=lens,
            )
            slots = s.phys[torch.tensor(sel, device=s.phys.device)]
            seg = (_sequences(meta, lens, slots), view, rows)
        s.built["chunks"] = (torch.tensor([first + ci for ci in c], device=h.device),
                             torch.tensor([ci == 0 for ci in c], device=h.device), win, seg)
    idx, zero, win, seg = s.built["chunks"]
    start = h[0].index_select(0, idx).to(ssm.dtype)  # [n, HV, V, K]
    start = torch.where(zero[:, None, None, None], init[1].to(start.device), start)
    ssm[s.phys] = start.to(ssm.device)
    xx = torch.cat([init[0][0].transpose(0, 1).to(x.dtype), x], 0)  # [W + rows, D]
    conv[s.phys] = xx[win].transpose(1, 2).to(conv.dtype)  # [n, D, W]
    if seg is not None:
        backend.forward_metadata, view, rows = seg
        original(backend, layer, view, x[rows], aa[rows], bb[rows], **kwargs)


def _by_segments(backend, original, layer, forward_batch, meta, s, x, aa, bb, init, conv, ssm,
                 kwargs):
    """Each segment, from the initial state to the first anchor and from each anchor to the
    next, replayed into the next anchor's slot (one backend call per anchor)."""
    for t, v in zip((conv, ssm), init):
        t[s.phys[:1]] = v
    if "segments" not in s.built:  # the same for every layer of this forward
        views, done = [], s.start
        for i, p in enumerate(s.positions):
            view = SimpleNamespace(
                forward_mode=forward_batch.forward_mode,
                extend_prefix_lens=torch.tensor([done], device=x.device),
                extend_seq_lens_cpu=[p - done],
            )
            views.append((_sequences(meta, [p - done], s.phys[i:i + 1]), view))
            done = p
        s.built["segments"] = views
    done = s.start
    for i, p in enumerate(s.positions):
        if i > 0:
            for t in (conv, ssm):
                t[s.phys[i:i + 1]] = t[s.phys[i - 1:i]]
        lo, hi = done - s.start, p - s.start
        backend.forward_metadata, view = s.built["segments"][i]
        original(backend, layer, view, x[lo:hi], aa[lo:hi], bb[lo:hi], **kwargs)
        done = p


def _sequences(meta, lens: List[int], slots: torch.Tensor):
    """The backend's forward metadata for sequences of ``lens`` tokens in ``slots``, with no
    state tracking of SGLang's own."""
    one = copy.copy(meta)
    one.query_start_loc = torch.tensor([0] + list(itertools.accumulate(lens)),
                                       dtype=meta.query_start_loc.dtype,
                                       device=meta.query_start_loc.device)
    one.mamba_cache_indices = slots.to(dtype=meta.mamba_cache_indices.dtype,
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
            if "segments" not in snap.built:
                anchors.states.snapped_from_chunks += 1
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
