"""The anchor states: recurrent-state checkpoints pinned in SGLang's hybrid radix cache, with
their own budget and LRU (paper §3.1).

A kept state is pinned by one request-style lock on its radix node
(``UnifiedRadixCache.inc_lock_ref``: the full-attention KV of its path and its mamba state),
so SGLang's own state LRU and its leaf eviction pass it by. Past the budget the least
recently used anchor is unpinned and its state freed, as SGLang frees a path-capped state
(``MambaComponent._evict_excess_path_states``). Bookkeeping only; no tensor moves here.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Dict, List, Optional

# Re-prefilled tokens per admitted request: histogram bucket upper bounds.
BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384)


def _mamba():
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType.MAMBA


def node_depth(node) -> int:
    """Tokens from the root to the end of ``node`` (a ``UnifiedTreeNode``)."""
    depth = 0
    while node is not None and node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


class AnchorStates:
    """The pinned anchor states of one ``UnifiedRadixCache`` (``cache``), at most ``budget``.

    Each pin also holds the full-attention KV of the node's path, so the anchors' KV (the
    union of their paths) is capped at ``token_cap`` tokens as well; past either bound the
    least recently used anchor goes. Its state is freed as SGLang frees a path-capped one,
    unless the node is a leaf or a fork, which are left to SGLang's own LRU.

    Counters (``snapshot``): ``states_kept`` (pinned, ever), ``states_evicted`` (unpinned by
    the budgets), ``states_flushed`` (dropped with the tree, ``/flush_cache``), ``states_held``
    (pinned now: kept - evicted - flushed), ``tokens_held`` (their KV), ``restores`` (admitted requests whose prefill
    started from an anchor state), and per admitted request the re-prefilled prompt tokens
    (``reprefill_tokens`` total, ``reprefill_histogram`` by ``BUCKETS``, ``last_reprefill``).
    """

    def __init__(self, cache, budget: int, token_cap: int):
        self.cache = cache
        self.budget = int(budget)
        self.token_cap = int(token_cap)
        # node id -> (node, its DecLockRefParams), least recently used first
        self.pinned: "OrderedDict[int, tuple]" = OrderedDict()
        self.kept = 0
        self.evicted = 0
        self.flushed = 0
        self.restores = 0
        self.requests = 0
        self.reprefill_total = 0
        self.hist = [0] * (len(BUCKETS) + 1)
        self.last_reprefill: Optional[int] = None
        # anchor states taken inside a forward (anchors.inside): inserted, and not had
        self.snapped = 0
        self.snapped_from_chunks = 0  # of snapped: from the kernel's chunk-start states
        self.missed = 0

    # -- the radix cache's side ------------------------------------------------------------
    def _component(self):
        ct = _mamba()
        for comp in self.cache._components_tuple:  # UnifiedRadixCache (private)
            if comp.component_type == ct:
                return comp
        raise RuntimeError("the radix cache has no mamba component")

    def node(self, ref):
        """The ``UnifiedTreeNode`` of ``ref`` (a node or SGLang's node id, as ``Req.last_node``
        holds it), or None when it is gone."""
        if ref is None or not isinstance(ref, int):
            return ref
        try:
            return self.cache.tree_core.node_by_id(ref)
        except (KeyError, AssertionError):
            return None

    def depth(self, ref) -> int:
        node = self.node(ref)
        return -1 if node is None else node_depth(node)

    def keep(self, ref) -> bool:
        """Pin the state of the node ``ref`` as an anchor (MRU); False when it holds no device
        state.

        Past the budget, the least recently used anchor goes (``_evict_oldest``)."""
        ct = _mamba()
        node = self.node(ref)
        if node is None or node.parent is None or node.component_data[ct].value is None:
            return False
        if node.id in self.pinned:
            self.pinned.move_to_end(node.id)
            return True
        if self.budget <= 0:
            return False
        lock = self.cache.inc_lock_ref(node.id)
        self.pinned[node.id] = (node, lock.to_dec_params())
        self.kept += 1
        while len(self.pinned) > self.budget or (
            len(self.pinned) > 1 and self.pinned_tokens() > self.token_cap
        ):
            self._evict_oldest()
        return True

    def pinned_tokens(self) -> int:
        """Full-attention KV tokens the anchors pin: the union of their paths."""
        seen, total = set(), 0
        for node, _ in self.pinned.values():
            while node is not None and node.parent is not None and node.id not in seen:
                seen.add(node.id)
                total += len(node.key)
                node = node.parent
        return total

    def touch(self, ref) -> bool:
        """A request restored from the node ``ref``: an anchor's state moves to MRU (True)."""
        node = self.node(ref)
        if node is not None and node.id in self.pinned:
            self.pinned.move_to_end(node.id)
            return True
        return False

    def _evict_oldest(self) -> None:
        _, (node, unlock) = self.pinned.popitem(last=False)
        self.evicted += 1
        comp = self._component()
        self.cache.dec_lock_ref(node.id, unlock)
        core = self.cache.tree_core
        cd = node.component_data[_mamba()]
        # the guards of _evict_excess_path_states: a leaf or a fork is left to SGLang's LRU
        if (cd.lock_ref == 0 and cd.value is not None and len(node.children) == 1
                and node not in core.evictable_device_leaves):
            # as MambaComponent._evict_excess_path_states frees a state (private helpers)
            from sglang.srt.mem_cache.unified_cache.components.tree_component import EvictLayer

            comp_types = self.cache.tree_components
            tracker = {c: 0 for c in comp_types}
            device_frees: Dict = defaultdict(list)
            host_frees: Dict = defaultdict(list)
            try:
                core._evict_component_and_detach_lru(
                    node, comp, device_frees, host_frees, target=EvictLayer.DEVICE,
                    tracker=tracker,
                )
                core._cascade_evict(node, comp, tracker, device_frees, host_frees)
            finally:
                self.cache._free_values(device_frees, host_frees)
        core._update_evictable_leaf_sets(node)

    def reset(self) -> None:
        """The tree was reset (``UnifiedRadixCache.reset``): no state is pinned any more."""
        self.flushed += len(self.pinned)
        self.pinned.clear()

    # -- counters --------------------------------------------------------------------------
    def admitted(self, reprefilled: int, restored_anchor: bool) -> None:
        reprefilled = max(0, int(reprefilled))
        self.requests += 1
        self.reprefill_total += reprefilled
        self.last_reprefill = reprefilled
        self.restores += int(restored_anchor)
        i = 0
        while i < len(BUCKETS) and reprefilled > BUCKETS[i]:
            i += 1
        self.hist[i] += 1

    def snapshot(self) -> Dict[str, object]:
        """The counters (read on the scheduler thread, which also keeps them)."""
        labels: List[str] = [f"<={b}" for b in BUCKETS] + [f">{BUCKETS[-1]}"]
        return {
            "states_kept": self.kept,
            "states_evicted": self.evicted,
            "states_flushed": self.flushed,
            "states_held": len(self.pinned),
            "budget": self.budget,
            "tokens_held": self.pinned_tokens(),
            "token_cap": self.token_cap,
            "restores": self.restores,
            "requests": self.requests,
            "reprefill_tokens": self.reprefill_total,
            "last_reprefill": self.last_reprefill,
            "reprefill_histogram": dict(zip(labels, self.hist)),
            "states_snapped": self.snapped,
            "snapped_from_chunks": self.snapped_from_chunks,
            "snaps_missed": self.missed,
        }
