"""Which (layer, expert) sits in which GPU slot: the LRU residency state and the per-layer
decision, on the device with no host sync (paper §3.2, §4.1).

Pure bookkeeping: no expert weight moves here. ``decide`` turns one MoE layer's routing into
a fill plan (host pool row -> slot) that ``fills.py`` carries out, and updates the residency
table, the slot owners, the LRU stamps and the counters in place. Every tensor has a shape
fixed by the batch shape, and every routing-dependent count stays on the device, so CUDA
graphs capture it.

The state, shared by all MoE layers:
    residency  int32 [L*E + 1]  slot of flat expert ``l*E + e``, or -1 (last entry: a sink)
    owner      int32 [S + 1]    flat expert id held by each slot, or -1 (last entry: a sink)
    key        int64 [S]        LRU key of each slot: ``stamp * S + slot``, where ``stamp`` is
                                the clock value of its last use (-1: never used)
    clock      int64 [1]        advanced once per layer call
    last_use   int64 [L*E]      clock value of each expert's last use: hit, fill or CPU run
                                (0: never); the admission rule reads it
    missed     int8  [L*E]      1 where the expert missed at its last use in a call under the
                                return rule (other calls leave it as it was)
    returns    fp32  [2]        (R, N): decayed counts of returns and of misses in calls under
                                the return rule (its rate r = R / N; a resize starts them at 0)
    late       int64 [1]        late fills planned since the last reset (``MissSplit.late_fill``)
    filled_at  int64 [S + 1]    clock value of each slot's last fill (-2: none since the cache
                                was built; last entry: a sink); the useful admission reads it

LRU order: the victims of a call's fills are the slots with the smallest keys, i.e. the
least recently used, ties broken by the lowest slot. Experts used by the call are stamped
with the new clock value before victims are chosen, so a slot used by the current step is
never evicted by that same step. Keys are unique, so the order is the same on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MissSplit:
    """How a layer call serves its ``m`` misses (paper §3.2, Eq. 4): ``q = min(m,
    max(min_fill, round(m * fill_ratio)))`` are filled into the cache, the other ``c = m - q``
    run on the CPU. ``fill_ratio = B_P / B_H`` with ``min_fill = 1`` is the q* policy;
    ``(1, 0)`` fills every miss; ``(0, 0)`` runs every miss on the CPU.

    With ``cpu_us > 0`` a cost check follows (the lone-miss rule, ``policy/miss.py``): the c
    CPU experts stay on the CPU only if their branch ends before filling all m would,
    ``cpu_fixed_us + c * cpu_us < fill_fixed_us + m * fill_us``; otherwise every miss is
    filled. Times in microseconds: per expert over PCIe (``fill_us``) and on the CPU beside a
    saturated link (``cpu_us``), and each branch's fixed cost per layer call.

    A miss is *reused* when its last use is more recent than the least recently used slot's
    (every miss while a slot is empty). With ``fill_reused`` (the re-miss rule,
    ``policy/miss.py``) every reused miss is filled and counts against the call's ``q``: of
    ``m`` misses with ``f`` reused, ``max(f, q)`` are filled (the other misses in expert order
    fill the rest of ``q``), and the cost check weighs the ``m - max(f, q)`` CPU experts
    (``fill_count_after``). With ``admit_reuse`` (the admission rule) only reused misses may be
    filled (at most q of them, in expert order); the other misses run on the CPU and leave the
    cache as it is. With both, exactly the reused misses are filled by the call (the late fill
    below aside). With ``admit_useful`` too (the useful admission) every miss is admitted, as
    without the rule, while the least recently used slot has been hit since its last fill (its
    stamp is newer than its ``filled_at``: the cache's fills are being used before they are
    evicted; *calm*), and only the reused ones otherwise (the fills are evicted unused:
    thrash); with ``fill_reused`` as well, the reused misses are filled only while calm (under
    thrash a forced fill would evict another slot's unused fill again), and under thrash they
    are admitted as above. With ``fill_reused_valued`` (its valued form) a reused miss is
    forced only where the uses it is expected to get before eviction, the LRU age over the
    time since its last use, reach ``B_H/B_P - 1`` (``valued_reuse``): a fill costs ``S/B_P``
    now, and the call's CPU run it replaces and each later hit save about ``S/B_H`` each. It
    is the same as ``fill_reused`` alone where ``fill_ratio >= 1/2``: a reused miss's LRU age
    always exceeds the time since its last use.

    With ``return_rule`` (``policy/miss.py``) the c CPU experts left after the above stay on
    the CPU only if the time they save now exceeds the fills they are expected to cost later
    (``keeps_cpu``), with ``r`` the measured rate at which missed experts are used again
    within the cache's LRU age (``ResidencyState.returns``); otherwise every miss is
    filled.

    With ``late_fill`` (the late fill, ``policy/miss.py``) a call whose split fills none of
    its misses (``q = 0`` after every rule, and ``fill_count(m) = 0``) runs them all on the
    CPU and also plans their fills into LRU victims, which the executor carries out *after*
    the call, beside the GPU's work (``LayerDecision.late``): the call does not wait for
    them, and the experts are resident for their next use. With ``late_all`` too, every
    other CPU run of a call is filled late as well (with ``admit_reuse``: the admitted ones);
    the call's own fills take the least recently used victims, the late ones the next."""

    fill_ratio: float = 1.0
    min_fill: int = 0
    fill_us: float = 0.0
    cpu_us: float = 0.0
    fill_fixed_us: float = 0.0
    cpu_fixed_us: float = 0.0
    admit_reuse: bool = False
    fill_reused: bool = False
    return_rule: bool = False
    late_fill: bool = False
    late_all: bool = False
    admit_useful: bool = False
    fill_reused_valued: bool = False

    @property
    def may_run_cpu(self) -> bool:
        """Whether a call's misses may run on the CPU: q < m for some m (``fill_ratio < 1``),
        or the admission rule, which sends every miss it does not admit there whatever q is
        (also where ``B_H <= B_P`` makes ``fill_ratio >= 1``). The executor launches and
        merges the CPU branch, and masks the CPU entries in the GPU MoE, exactly when true."""
        return self.fill_ratio < 1.0 or self.admit_reuse


FILL_ALL = MissSplit(1.0, 0)


@dataclass
class CpuWork:
    """The work items of a layer call's CPU-executed experts: item ``i < count[0]`` adds
    ``weights[i] * expert_{experts[i]}(x[rows[i]])`` to the layer output. Fixed shapes
    ``[T*k]``; entries at or past ``count`` are unspecified."""

    rows: torch.Tensor  # int32 [T*k] token rows
    experts: torch.Tensor  # int32 [T*k] flat expert ids l*E+e
    weights: torch.Tensor  # fp32 [T*k] router weight x routed scaling factor
    count: torch.Tensor  # int32 [1]


@dataclass
class LayerDecision:
    """What ``decide`` returns for one layer call.

    ``routed_ids`` (int [T, k]) are the local expert ids for the GPU compute over slots:
    padded rows carry row 0's ids, and entries whose expert runs on the CPU are -1 (they
    contribute nothing on the GPU); every other id is resident. (A decode call that runs the
    decision beside SGLang's alignment, ``execute/decode.py``, computes from the router's ids
    and the slots instead.)

    ``late`` (with ``MissSplit.late_fill``, else None): fills of CPU-run experts that no
    compute of this call waits for (``K`` entries of their own, like ``plan``).
    """

    plan: "FillPlan"
    routed_ids: torch.Tensor
    cpu: CpuWork
    late: "FillPlan | None" = None


@dataclass
class FillPlan:
    """The fills one layer call needs: copy pool row ``src[i]`` into slot ``dst[i]`` for
    ``i < count[0]``. Shapes are fixed (``[K]``, ``[K]``, ``[1]``, K = max unique experts of
    the call); entries at or past ``count`` are unspecified."""

    src: torch.Tensor  # int32 [K] flat expert ids l*E+e
    dst: torch.Tensor  # int32 [K] slots
    count: torch.Tensor  # int32 [1]


class ResidencyState:
    """The device-resident LRU state of the GPU expert cache (see the module docstring).

    Args:
        num_rows: L*E flat experts.
        num_slots: S slots.
        device: where the state lives (the cache's device).
    """

    def __init__(self, num_rows: int, num_slots: int, device):
        self.num_rows = num_rows
        self.num_slots = num_slots
        i32 = dict(dtype=torch.int32, device=device)
        self.residency = torch.full((num_rows + 1,), -1, **i32)
        self.owner = torch.full((num_slots + 1,), -1, **i32)
        self.slots = torch.arange(num_slots, dtype=torch.int64, device=device)
        self.key = self.slots - num_slots
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.last_use = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.missed = torch.zeros(num_rows, dtype=torch.int8, device=device)
        self.returns = torch.zeros(2, dtype=torch.float32, device=device)
        self.late = torch.zeros(1, dtype=torch.int64, device=device)
        self.filled_at = torch.full((num_slots + 1,), -2, dtype=torch.int64, device=device)

    @property
    def return_rate(self) -> float:
        """r: the decayed share of misses whose expert was used again within the cache's LRU
        age (a hit, or a miss more recent than the least recently used slot); 0 before any
        miss. Reads the device (a sync): for stats, not the decode path."""
        r, n = self.returns.tolist()
        return min(1.0, r / n) if n > 0 else 0.0

    @property
    def stamp(self) -> torch.Tensor:
        """int64 [S]: last-use clock value of each slot (-1: never used)."""
        return torch.div(self.key, self.num_slots, rounding_mode="floor")

    def reset(self) -> None:
        """Empty every slot (in place, keeping tensor addresses for captured graphs)."""
        self.residency.fill_(-1)
        self.owner.fill_(-1)
        torch.sub(self.slots, self.num_slots, out=self.key)
        self.clock.zero_()
        self.last_use.zero_()
        self.missed.zero_()
        self.returns.zero_()
        self.late.zero_()
        self.filled_at.fill_(-2)

    def make_all_resident(self) -> None:
        """Slot ``i`` holds flat expert ``i`` for every expert.

        Raises:
            ValueError: fewer slots than experts (S < L*E).
        """
        if self.num_slots < self.num_rows:
            raise ValueError(
                f"{self.num_slots} slots cannot hold all {self.num_rows} experts resident"
            )
        ids = torch.arange(self.num_rows, dtype=torch.int32, device=self.owner.device)
        self.reset()
        self.residency[: self.num_rows] = ids
        self.owner[: self.num_rows] = ids
        self.key[: self.num_rows] = self.slots[: self.num_rows]  # stamp 0

    def layer_slots(self, ordinal: int, num_experts: int) -> torch.Tensor:
        """int32 [E] view: slot of each expert of MoE layer ``ordinal`` (or -1)."""
        base = ordinal * num_experts
        return self.residency[base : base + num_experts]


def max_unique_experts(num_tokens: int, top_k: int, num_experts: int) -> int:
    """K: the most distinct experts one layer call over ``num_tokens`` rows can route to."""
    return max(1, min(num_experts, num_tokens * top_k))


def used_experts(
    topk_ids: torch.Tensor, num_valid: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """bool [E]: experts routed to by a valid row. Rows at or past ``num_valid[0]`` (batch
    padding of a captured graph) are ignored.

    Args:
        topk_ids: int [T, k] local expert ids of the layer.
        num_valid: int [1] on the same device: the number of real rows.
    """
    t, k = topk_ids.shape
    rows = torch.arange(t, device=topk_ids.device).unsqueeze(1)
    valid = rows < num_valid.to(rows.dtype)
    ids = torch.where(valid, topk_ids.long(), num_experts).reshape(-1)
    used = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_ids.device)
    used.index_fill_(0, ids, 1)
    return used[:num_experts].bool()


def decide(
    state: ResidencyState,
    counters: torch.Tensor,
    ordinal: int,
    num_experts: int,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_valid: torch.Tensor,
    split: MissSplit = FILL_ALL,
    weight_scale: float = 1.0,
    post=None,
) -> LayerDecision:
    """Classify one MoE layer call's routed experts as hits or misses, split the misses between
    cache fills and CPU execution, choose LRU victims for the fills, and update the state.

    Args:
        state: the shared residency state.
        counters: int64 [5, L] per-layer counters (reads, hits, fills, evictions, cpu),
            updated in place (``stats.py``).
        ordinal: the layer's MoE ordinal ``l``.
        num_experts: E.
        topk_ids: int [T, k] local expert ids routed to by each row.
        topk_weights: fp32 [T, k] router weights.
        num_valid: int [1] number of real rows (the rest is graph padding).
        split: how misses are served (fill every miss for prefill).
        weight_scale: the layer's routed scaling factor, folded into the CPU items' weights.
        post: a ``kernels.doorbell.DoorbellPost`` (CUDA only): the decision kernel also posts
            a call with CPU items to the doorbell CPU branch (``CpuBranch.post_target``).

    Returns:
        A LayerDecision: the fills (``K = max_unique_experts(T, k, E)`` entries), the routed
        ids for the GPU compute and the CPU work items. CPU-executed experts stay out of the
        cache (every used expert's clock is recorded in ``state.last_use``).

    On CUDA this is one single-program Triton kernel (``kernels/residency.py``); elsewhere
    the torch reference below. Both give identical results. The cache must have
    ``S >= K`` slots (the executor choice, ``execute/choice.py``, sends larger calls elsewhere).

    Raises:
        ValueError: ``post`` off CUDA, or one that does not fit (``decide_triton``).
    """
    if topk_ids.is_cuda:
        from freetoken_sglang.kernels.residency import decide_triton

        return decide_triton(
            state, counters, ordinal, num_experts, topk_ids, topk_weights, num_valid,
            split, weight_scale, post,
        )
    if post is not None:
        raise ValueError("decide: a doorbell post needs the decision kernel (CUDA tensors)")
    return decide_reference(
        state, counters, ordinal, num_experts, topk_ids, topk_weights, num_valid,
        split, weight_scale,
    )


def fill_count(num_misses: torch.Tensor, split: MissSplit) -> torch.Tensor:
    """q of ``MissSplit`` (round half up, then the cost check), in double precision, as a
    tensor like ``num_misses`` (the decision kernel reads it from a table of this function,
    ``kernels/residency.py`` ``q_table``)."""
    return fill_count_after(torch.zeros_like(num_misses), num_misses, split)


def fill_count_after(forced: torch.Tensor, rest: torch.Tensor, split: MissSplit) -> torch.Tensor:
    """Fills among the ``rest`` misses of a call whose ``forced`` misses are filled anyway (the
    re-miss rule): the call's q over all ``forced + rest`` misses is ``max(forced, q*)``, where
    q* is ``fill_count``'s split before its cost check; the cost check then weighs the CPU
    experts left. Tensors of one integer dtype, broadcast; ``forced = 0`` gives
    ``fill_count(rest)``. The decision kernel reads it from ``q_table``."""
    m = forced + rest
    q = torch.floor(m.double() * split.fill_ratio + 0.5).to(m.dtype)
    q = torch.maximum(forced, torch.minimum(m, q.clamp(min=split.min_fill)))
    if split.cpu_us > 0:
        c = (m - q).double()
        cpu_end = split.cpu_fixed_us + c * split.cpu_us
        fill_all = split.fill_fixed_us + m.double() * split.fill_us
        q = torch.where((c > 0) & (cpu_end >= fill_all), m, q)
    return q - forced


def reuse_need(split: MissSplit) -> float:
    """``B_H/B_P - 1`` (``1/fill_ratio - 1``; infinite where ``fill_ratio`` is 0): the later
    uses a reused miss must be expected to get before eviction for the valued re-miss rule to
    fill it (``MissSplit.fill_reused_valued``)."""
    return 1.0 / split.fill_ratio - 1.0 if split.fill_ratio > 0 else float("inf")


def valued_reuse(age: torch.Tensor, gap: torch.Tensor, split: MissSplit) -> torch.Tensor:
    """The valued re-miss rule's test (``MissSplit.fill_reused_valued``): bool, where ``age``
    (the clock since the least recently used slot's stamp) is at least ``reuse_need`` times
    ``gap`` (the clock since the miss's last use, at least 1): the expected uses before
    eviction. fp32 arithmetic, as in the decision kernel."""
    need = torch.tensor(reuse_need(split), dtype=torch.float32, device=age.device)
    return age.float() >= need * gap.clamp(min=1).float()


def keeps_cpu(q: torch.Tensor, m: torch.Tensor, rate: torch.Tensor,
               split: MissSplit) -> torch.Tensor:
    """The return rule (``MissSplit.return_rule``): whether a call's ``c = m - q`` CPU experts
    (``q`` fills of ``m`` misses) stay on the CPU. They save, now, ``T_fill(m) - max(T_fill(q),
    T_cpu(c))`` = ``min(c S/B_P [+ F_P if q = 0], F_P + m S/B_P - F_H - c S/(B_H - B_P))`` (the
    branch times of ``policy/miss.py``), and are expected to cost ``rate * c`` later fills of
    ``S/B_P`` each (the returning ones miss again): they stay where the saving is larger.
    bool tensor; fp32 arithmetic as in the decision kernel; True where ``c = 0``."""
    q, m = q.float(), m.float()
    c = m - q
    f = split.fill_us
    by_fill = c * f + torch.where(q > 0, 0.0, split.fill_fixed_us)
    by_cpu = (split.fill_fixed_us - split.cpu_fixed_us) + m * f - c * split.cpu_us
    return (c <= 0) | (torch.minimum(by_fill, by_cpu) > rate * c * f)


def decide_reference(
    state: ResidencyState,
    counters: torch.Tensor,
    ordinal: int,
    num_experts: int,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_valid: torch.Tensor,
    split: MissSplit = FILL_ALL,
    weight_scale: float = 1.0,
) -> LayerDecision:
    """``decide`` in plain torch ops (the CPU path and the kernel's reference)."""
    device = topk_ids.device
    S = state.num_slots
    E = num_experts
    T, k = topk_ids.shape
    K = max_unique_experts(T, k, E)
    base = ordinal * E

    used = used_experts(topk_ids, num_valid, E)
    layer_res = state.layer_slots(ordinal, E)
    hit = used & (layer_res >= 0)
    miss = used & (layer_res < 0)

    state.clock.add_(1)
    now = state.clock  # [1]

    # Stamp the hits first, so that no slot used by this call can be a victim.
    hit_slot = torch.where(hit, layer_res, S).long()
    key_ext = torch.cat([state.key, state.key.new_zeros(1)])
    key_ext.index_copy_(0, hit_slot, now * S + hit_slot)
    state.key.copy_(key_ext[:S])

    # Reused misses: used more recently than the least recently used slot (stamp -1 while a
    # slot is empty: every miss). The re-miss rule fills them all and counts them in q; the
    # rest of q goes to the other misses, any of them or (admission) only reused ones.
    layer_last = state.last_use[base : base + E]
    rules = split.admit_reuse or split.fill_reused or split.return_rule
    if rules and S > 0 and bool(miss.any()):
        oldest = torch.div(state.key.min(), S, rounding_mode="floor")
        within = miss & (layer_last > oldest)
    else:
        oldest = None
        within = torch.zeros_like(miss)
    reused = within if (split.admit_reuse or split.fill_reused) else torch.zeros_like(miss)
    returning = split.return_rule and S > 0
    if returning:
        # The return rate: experts that missed at their last use and are used again within
        # the LRU age (hits, or misses more recent than the least recently used slot), over
        # the misses; both decay by 1 - 1/age per call with misses (age: the clock since the
        # least recently used slot's stamp), so r follows the cache's own residency time.
        layer_missed = state.missed[base : base + E]
        n_ret = ((layer_missed > 0) & (hit | within)).sum().float()
        rn = state.returns
        if oldest is not None:
            rn.mul_(1.0 - 1.0 / (now - oldest).clamp(min=1).float())
        rn[0] += n_ret
        rate = torch.where(rn[1] > 0, rn[0] / rn[1].clamp(min=1e-30),
                           rn.new_zeros(())).clamp(max=1.0)
    forced = reused if split.fill_reused else torch.zeros_like(miss)
    if split.admit_reuse and split.admit_useful and oldest is not None:
        # the useful admission: while the least recently used slot was hit since its last
        # fill (calm; its stamp is the oldest, keys are unique, so argmin is that slot) every
        # miss is admitted and the re-miss rule fills the reused ones; else neither
        lru = torch.argmin(state.key)
        calm = oldest > state.filled_at[lru]
        admitted = reused | calm
        forced = forced & calm
    else:
        admitted = reused
    if split.fill_reused and split.fill_reused_valued and oldest is not None:
        forced = forced & valued_reuse(now - oldest, now - layer_last, split)
    rest = miss & ~forced
    eligible = rest & admitted if split.admit_reuse else rest
    q = torch.minimum(fill_count_after(forced.sum().int(), rest.sum().int(), split),
                      eligible.sum().int())
    fill = forced | (eligible & (torch.cumsum(eligible.int(), 0) - 1 < q))
    if returning:
        fill = torch.where(keeps_cpu(fill.sum(), miss.sum(), rate, split), fill, miss)
        rn[1] += miss.sum().float()
        layer_missed.copy_(torch.where(used, miss.to(torch.int8), layer_missed))
    cpu = miss & ~fill
    if split.late_fill and S > 0:
        # A call that fills none of its misses by Eq. 4 and every rule fills them late;
        # with late_all, every other CPU run the admission rule admits (all without it) too.
        late_call = (fill.sum() == 0) & (fill_count(miss.sum().int(), split) == 0)
        late = miss & late_call
        if split.late_all:
            late = late | (cpu & admitted if split.admit_reuse else cpu)
    else:
        late = torch.zeros_like(miss)
    # a slot for each: the call's own fills take the first victims, the late ones the next
    q_own = fill.sum()
    rank = torch.where(fill, torch.cumsum(fill.int(), 0) - 1,
                       q_own + torch.cumsum(late.int(), 0) - 1)
    own = fill
    fill = fill | late

    # The K least recently used slots, oldest first (keys are unique).
    cand = torch.topk(state.key, min(K, S), largest=False, sorted=True).indices
    if cand.numel() == 0:  # no slot at all (the pure-CPU backend): nothing is filled
        cand = torch.full((1,), S, dtype=torch.int64, device=device)

    # The i-th filled miss (in expert order) takes the i-th candidate.
    victim = cand[rank.clamp(0, cand.numel() - 1)]
    victim = torch.where(fill, victim, S).int()  # S: the owner table's sink entry
    old = state.owner[victim.long()]
    evicted = fill & (old >= 0)
    sink_row = state.num_rows
    state.residency.index_fill_(0, torch.where(evicted, old, sink_row).long(), -1)
    flat = torch.arange(base, base + E, device=device, dtype=torch.int32)
    state.residency[base : base + E] = torch.where(fill, victim, layer_res)
    state.owner.index_copy_(0, victim.long(), torch.where(fill, flat, -1))
    state.residency[sink_row] = -1
    state.owner[S] = -1
    key_ext = torch.cat([state.key, state.key.new_zeros(1)])
    key_ext.index_copy_(0, victim.long(), now * S + victim.long())
    state.key.copy_(key_ext[:S])
    state.filled_at.index_fill_(0, victim.long(), now.squeeze(0))  # (non-fills: the sink)
    state.filled_at[S] = -2
    layer_last.copy_(torch.where(used, now, layer_last))

    # Fill lists: compact the call's own fills, and apart the late ones, in expert order.
    def compact(which, first):
        pos = torch.where(which, rank - first, K).long()
        src = torch.zeros(K + 1, dtype=torch.int32, device=device)
        dst = torch.zeros(K + 1, dtype=torch.int32, device=device)
        src.index_copy_(0, pos, flat)
        dst.index_copy_(0, pos, victim)
        return src[:K], dst[:K]

    src, dst = compact(own, 0)
    n_late = late.sum()
    count = q_own.int().reshape(1)
    state.late += n_late

    counters[:, ordinal] += torch.stack(
        [used.sum(), hit.sum(), fill.sum() - n_late, evicted.sum(), cpu.sum()]
    ).long()

    # Routing for the GPU compute, and the CPU work items (row-major order).
    rows = torch.arange(T, device=device).unsqueeze(1)
    valid = rows < num_valid.to(rows.dtype)
    routed = torch.where(valid, topk_ids, topk_ids[:1])
    on_cpu = cpu[routed.long()]
    routed = torch.where(on_cpu, -1, routed).to(topk_ids.dtype)
    emit = (on_cpu & valid).reshape(-1)
    n = int(emit.sum())
    idx = emit.nonzero().squeeze(1)
    work = CpuWork(
        rows=torch.zeros(T * k, dtype=torch.int32, device=device),
        experts=torch.zeros(T * k, dtype=torch.int32, device=device),
        weights=torch.zeros(T * k, dtype=torch.float32, device=device),
        count=torch.tensor([n], dtype=torch.int32, device=device),
    )
    work.rows[:n] = (idx // k).int()
    work.experts[:n] = (topk_ids.reshape(-1)[idx] + base).int()
    work.weights[:n] = topk_weights.reshape(-1)[idx].float() * weight_scale
    late_plan = None
    if split.late_fill:
        late_src, late_dst = compact(late, q_own)
        late_plan = FillPlan(src=late_src, dst=late_dst, count=n_late.int().reshape(1))
    return LayerDecision(FillPlan(src=src, dst=dst, count=count), routed, work, late_plan)
