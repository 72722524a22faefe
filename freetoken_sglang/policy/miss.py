"""The decode miss policy: how a layer call's misses split between cache fills and the CPU.

Three policies split a layer call's m missed experts between cache fills over PCIe and
in-place CPU execution (paper §3.2, Eq. 1-4):

- ``qstar``: ``q* = round(m * B_P / B_H)`` fills, at least one, the rest on the CPU, unless
  the lone-miss rule below fills them all;
- ``fill``: every miss is filled (no CPU execution);
- ``cpu``: every miss runs on the CPU and decode never changes residency (a
  KTransformers-like placement that only prefill updates: through the LRU with
  ``--freetoken-prefill lru``; under streaming, the last layers' experts that borrowed
  buffers give back, and nothing with reserved buffers).

The rules below go beyond the paper. The lone-miss rule applies wherever ``qstar`` knows the
branches' fixed costs; the others are flags, off by default (the host rates: ``alone``, the
paper's). What each measured is in benchmarks/RESULTS.md.

The lone-miss rule (Eq. 4 has no fixed costs): the CPU branch pays a fixed cost ``F_H`` per
call with work (the executor's start and join, measured), so at high hit rates a lone CPU
expert can cost more than its fill. With the paper's own branch times (Eq. 3),
``T_fill(q) = F_P + q S / B_P`` and ``T_cpu(c) = F_H + c S / (B_H - B_P)``, the split keeps its
``c = m - q`` CPU experts only if ``T_cpu(c) < T_fill(m)``, i.e. the CPU branch ends before
filling all ``m`` would; otherwise all ``m`` are filled. ``S`` is one expert's bytes; every
term is measured (``rates.py``), none tuned. Where ``B_H <= B_P`` the CPU has no residual
bandwidth and every miss is filled, as Eq. 4 degenerates (but for the misses the admission rule
below does not admit: those run on the CPU at any B_P / B_H).

The re-miss rule (``--freetoken-fill-reused on``): an expert the CPU served is not in the
cache, so when its routing repeats it misses again, and Eq. 4 weighs one call only. A miss is
*reused* when its last use is more recent than the least recently used slot's: had it been
filled then, it would still be resident, so it is filled now (with the useful admission
below: only while the cache is calm). Each expert then runs on the CPU at most once per stay
within the cache's LRU age. The threshold is the cache's own LRU age, not a tuned constant
(``cache/residency.py``). The forced fills take their PCIe time out of Eq. 4's balance: of m
misses with f reused, ``max(f, q*(m))`` are filled, the reused ones first, and the lone-miss
rule weighs the CPU experts left. Its valued form (``--freetoken-fill-reused valued``) forces
a reused miss only where its expected uses before eviction, the LRU age over the time since
its last use, reach B_H/B_P - 1 (a fill costs S/B_P; the CPU run it replaces and each later
hit save about S/B_H); it is the same as ``on`` where B_P/B_H >= 1/2, since a reused miss's
LRU age always exceeds the time since its last use. The reused misses it does not force are
split like the others (with the admission rule: admitted, then split by q*).

The admission rule (``--freetoken-admission reuse``): under thrash, LRU fills experts that are
evicted before their next use. A miss is fillable only if its last use is more recent than
the least recently used slot's: had it been admitted then, it would still be resident, so its
reuse distance is within the cache's residency time. The others run on the CPU and the cache
keeps what it has; q* still caps the fills. With the re-miss rule too (not its valued form),
exactly the reused misses are filled and the others run on the CPU, whatever q* and the
lone-miss rule say (the late fill may still fill a call's misses after it): a second use
within the cache's LRU age admits an expert.
In its useful form (``--freetoken-admission useful``) the rule is on only while the cache
thrashes: as long as the least recently used slot has been hit since its last fill (the fills
are used before they are evicted, as where the cache holds the working set), every miss is
admitted as without the rule; once that slot's fill went unused until it became the least
recently used, only reused misses are. The signal is the cache's own state, one comparison
per call with misses, not a tuned constant. With the re-miss rule too, the reused misses are
filled only while calm (the first state): under thrash a forced fill evicts another slot's
unused fill, so there they are only admitted, q* splitting them.

The return rule (``--freetoken-return-rule on``): Eq. 4 weighs one call, but an expert the
CPU served stays out of the cache, and if its routing returns before the cache would have
evicted it, it misses again and is filled then: its CPU run saved this call's fill only to
pay it later. The cache measures r, the share of misses whose expert is used again within the
LRU age (a hit, or a miss more recent than the least recently used slot), decayed over that
age (``cache/residency.py``). A call's c CPU experts stay on the CPU only if the time they
save now, ``T_fill(m) - max(T_fill(q), T_cpu(c))``, exceeds ``r c S / B_P``, the fills the
returning ones cost later; otherwise all m are filled. At r = 1 (a cache that holds the
working set) the split can only tie, and every miss is filled; at r = 0 (thrash) it is the
lone-miss rule. Every term is measured (the fixed costs too: it needs them); r starts at 0
at every resize or policy change. It combines with the re-miss rule, not with the
admission rule (whose first misses run on the CPU by design, and return when it works).

The late fill (``--freetoken-late-fill on``): Eq. 4 rounds a lone miss's q* to zero
(``m B_P / B_H < 1/2``), and the paper then fills it anyway (at least one fill per call), so
the call waits a whole fill, S / B_P, where the CPU would have taken about S / B_H; running it
on the CPU instead leaves it out of the cache, and it misses again when its routing returns.
With the late fill, a call whose split fills none of its misses runs them all on the CPU and
fills them *after* the call: the copies go on a side stream beside the GPU's work on the next
layers, no compute of the step waits for them, and the step's last MoE layer joins them. The
call pays the CPU branch, the cache still learns the expert. In this form (``on``) only calls
with no fill of their own fill late (with B_P / B_H near 1/3: one miss), so at bs1 the late
copies of a step add at most one expert per MoE layer to the link, never more than ``fill``
would have moved in those calls. q* drops the paper's at-least-one fill (its reason, that the
cache learns, is met by the late fill). Combines with the admission and re-miss rules, not
with the return rule (which weighs the later fills the late fill removes). The CPU runs of
calls that do fill still stay out of the cache and miss again: ``--freetoken-late-fill all``
fills those late too (of those, the ones the admission rule admits, where it is on; a call
that fills none of its misses still fills them all late, as under ``on``): the cache then
learns every miss as under ``fill`` (every admitted one), while each call waits only for its
own q* fills and CPU runs; the late copies share the link with later calls' fills.

The host rates (``--freetoken-host-rates``): Eq. 3 takes the CPU's rate beside a busy link to
be B_H - B_P, the host memory's rate less what the fills take. Measured beside each other,
the two can share it better than that, and the paper's split then fills more than it
balances. ``beside`` reads both rates measured while the other runs, B_P' and B_H'
(``rates.measure_beside``), as ``(B_P', B_P' + B_H')``: Eq. 3's CPU rate is then B_H', Eq. 4
balances ``q / (m - q) = B_P' / B_H'``, and the lone-miss and valued re-miss rules weigh the
same two (the lone-miss rule's "fill all m" too, at B_P', though no CPU work runs then:
slightly long, so it leans to keeping the CPU experts). ``alone`` (default) is the paper's.

Layer calls over more than ``SPLIT_MAX_TOKENS`` rows that reach the LRU (prefill chunks that
do not stream, ``execute/choice.py``) fill every miss in all three policies; the decision is
made from shapes alone, so captured graphs keep it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple

from freetoken_sglang.cache.residency import FILL_ALL, MissSplit

if TYPE_CHECKING:
    from freetoken_sglang.policy.words import PolicyWords

POLICIES = ("qstar", "fill", "cpu")


# Layer calls with at most this many rows (decode steps, short prefills) split their misses.
SPLIT_MAX_TOKENS = 64

# A per-expert CPU time that never wins (no residual host bandwidth); finite for the kernel.
UNREACHABLE_US = 1e30


@dataclass(frozen=True)
class MissPolicy:
    """A miss policy and the measurements it was derived from.

    Args:
        name: one of ``POLICIES``.
        bandwidth: ``(B_P, B_H)`` in GB/s (needed by ``qstar``).
        fixed_us: ``(F_P, F_H)``, the fill and CPU branches' fixed costs per layer call in
            microseconds (``rates.Bandwidth``); ``None``: unknown, no lone-miss rule.
        expert_bytes: S, one expert's bytes in the pool (needed with ``fixed_us``).
        admission: the admission rule (``qstar`` only).
        fill_reused: the re-miss rule (``qstar`` only).
        return_rule: the return rule (``qstar`` only; needs ``expert_bytes``).
        late_fill: the late fill (``qstar`` only; not with the return rule).
        late_all: with ``late_fill``, every admitted CPU run fills late (``all``).
        admit_useful: with ``admission``, its useful form (``--freetoken-admission useful``).
        fill_reused_valued: with ``fill_reused``, its valued form (``--freetoken-fill-reused
            valued``: ``MissSplit.fill_reused_valued``).
        host_rates: ``alone`` (the paper's) or ``beside``: which rates ``bandwidth`` holds
            (``rates.Bandwidth.split_rates``), for the description and the label.

    Raises:
        ValueError: unknown name, ``qstar`` without positive bandwidths, ``fixed_us`` or the
            return rule without ``expert_bytes``, the return rule without ``fixed_us``, a rule
            without ``qstar``, the admission rule with the return rule, or the late fill with
            the return rule, ``late_all`` without ``late_fill``, ``admit_useful`` without
            ``admission``, ``fill_reused_valued`` without ``fill_reused``, or ``host_rates``
            not ``alone`` or ``beside``, or ``beside`` without ``qstar``.
    """

    name: str
    bandwidth: Optional[Tuple[float, float]] = None
    fixed_us: Optional[Tuple[float, float]] = None
    expert_bytes: int = 0
    admission: bool = False
    fill_reused: bool = False
    return_rule: bool = False
    late_fill: bool = False
    late_all: bool = False
    admit_useful: bool = False
    fill_reused_valued: bool = False
    host_rates: str = "alone"

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"miss policy must be one of {POLICIES}, got {self.name!r}")
        if self.host_rates not in ("alone", "beside"):
            raise ValueError(f"host rates must be alone or beside, got {self.host_rates!r}")
        if self.host_rates == "beside" and self.name != "qstar":
            raise ValueError("the host rates beside each other (--freetoken-host-rates "
                             "beside) need the qstar miss policy")
        if self.name == "qstar":
            if not self.bandwidth or min(self.bandwidth) <= 0:
                raise ValueError("the qstar miss policy needs positive B_P and B_H")
            if (self.fixed_us is not None or self.return_rule) and self.expert_bytes <= 0:
                raise ValueError("the lone-miss and return rules need the expert's bytes")
            if self.return_rule and self.fixed_us is None:
                raise ValueError("the return rule needs the branches' fixed costs: give "
                                 "--freetoken-bandwidth B_P,B_H,F_P,F_H or let FreeToken "
                                 "measure them (python -m freetoken_sglang.profile)")
        elif self.admission or self.fill_reused or self.return_rule or self.late_fill:
            rule = ("admission rule" if self.admission else "re-miss rule" if self.fill_reused
                    else "return rule" if self.return_rule else "late fill")
            raise ValueError(f"the {rule} needs the qstar miss policy")
        if self.admission and self.return_rule:
            raise ValueError("the return rule would fill the misses the admission rule sends "
                             "to the CPU on purpose: give one of them")
        if self.admit_useful and not self.admission:
            raise ValueError("admit_useful is a form of the admission rule: give admission too")
        if self.fill_reused_valued and not self.fill_reused:
            raise ValueError("fill_reused_valued is a form of the re-miss rule: give "
                             "fill_reused too")
        if self.late_all and not self.late_fill:
            raise ValueError("late_all is a form of the late fill: give late_fill too")
        if self.late_fill and self.return_rule:
            raise ValueError("the return rule weighs later fills that the late fill removes: "
                             "give one of them")

    @property
    def decode_split(self) -> MissSplit:
        """The split of a decode-sized layer call."""
        if self.name == "fill":
            return FILL_ALL
        if self.name == "cpu":
            return MissSplit(0.0, 0)
        b_p, b_h = self.bandwidth
        min_fill = 0 if self.late_fill else 1
        if self.fixed_us is None:
            return MissSplit(b_p / b_h, min_fill, admit_reuse=self.admission,
                             fill_reused=self.fill_reused, late_fill=self.late_fill,
                             late_all=self.late_all, admit_useful=self.admit_useful,
                             fill_reused_valued=self.fill_reused_valued)
        f_p, f_h = self.fixed_us
        fill_us = self.expert_bytes / (b_p * 1e3)  # bytes / (GB/s) in us
        # Beside a saturated link the CPU reads at B_H - B_P (Eq. 2); none left: always fill.
        cpu_us = self.expert_bytes / ((b_h - b_p) * 1e3) if b_h > b_p else UNREACHABLE_US
        return MissSplit(b_p / b_h, min_fill, fill_us, cpu_us, f_p, f_h, self.admission,
                         self.fill_reused, self.return_rule, self.late_fill, self.late_all,
                         self.admit_useful, self.fill_reused_valued)

    def split_for(self, num_tokens: int, decode: bool = True) -> MissSplit:
        """The split of a layer call over ``num_tokens`` rows (prefill-sized calls fill); in
        a forward that is not a decode step (``decode`` False: short prefills, whose graphs
        SGLang may break into pieces) without the late fill."""
        if num_tokens > SPLIT_MAX_TOKENS:
            return FILL_ALL
        if self.late_fill and not decode:
            return dataclasses.replace(self.decode_split, late_fill=False, late_all=False,
                                       min_fill=1)
        return self.decode_split

    def cpu_count(self, num_misses: int) -> int:
        """How many of a decode call's ``num_misses`` misses run on the CPU (0: every miss is
        filled) when none of them is reused, for the log and the tests; with the admission
        rule at least this many (the misses it does not admit run there too)."""
        import torch

        from freetoken_sglang.cache.residency import fill_count

        q = int(fill_count(torch.tensor(num_misses), self.decode_split))
        return num_misses - q

    @property
    def label(self) -> str:
        """The policy and its rules in the flags' words: ``fill``, ``qstar``, ``cpu``,
        ``qstar+admission`` (``qstar+admission_useful``), ``qstar+fill_reused``,
        ``qstar+admission+fill_reused`` (``fill_reused_valued`` for its valued form), each
        of the qstar ones optionally followed by
        ``+return_rule``, ``+late_fill`` or ``+late_fill_all``, and ``+beside`` with the
        host rates beside each other."""
        rule = (("+admission_useful" if self.admit_useful else "+admission") if self.admission
                else "") + ("+fill_reused" if self.fill_reused else "") + (
                    "_valued" if self.fill_reused_valued else "")
        return (self.name + rule + ("+return_rule" if self.return_rule else "")
                + ("+late_fill" if self.late_fill else "")
                + ("_all" if self.late_all else "")
                + ("+beside" if self.host_rates == "beside" else ""))

    @property
    def words(self) -> "PolicyWords":
        """This policy in its flags' words (``PolicyWords``; every word given)."""
        from freetoken_sglang.policy.words import PolicyWords

        return PolicyWords(
            self.name,
            admission=("useful" if self.admit_useful else "reuse") if self.admission else "off",
            fill_reused=(("valued" if self.fill_reused_valued else "on") if self.fill_reused
                         else "off"),
            return_rule="on" if self.return_rule else "off",
            late_fill=("all" if self.late_all else "on") if self.late_fill else "off",
            host_rates=self.host_rates)

    def describe(self) -> str:
        if self.name != "qstar":
            return self.name
        b_p, b_h = self.bandwidth
        adm = "admission rule (useful)" if self.admit_useful else "admission rule (reuse)"
        text = (f"qstar with the {adm} and the re-miss rule " if self.admission and
                self.fill_reused else f"qstar with the {adm} " if self.admission else
                "qstar with the re-miss rule " if self.fill_reused else "qstar ")
        text += "and the return rule " if self.return_rule else ""
        text += ("and the late fill of every admitted CPU run " if self.late_all else
                 "and the late fill " if self.late_fill else "")
        if self.host_rates == "beside":
            text += (f"(beside each other B_P' {b_p:.1f} GB/s, B_H' {b_h - b_p:.1f} GB/s, "
                     f"q*/m = B_P'/(B_P' + B_H') = {b_p / b_h:.3f}")
        else:
            text += (f"(B_P {b_p:.1f} GB/s, B_H {b_h:.1f} GB/s, q*/m = B_P/B_H = "
                     f"{b_p / b_h:.3f}")
        if (self.admission and self.fill_reused and not self.admit_useful
                and not self.fill_reused_valued):
            return text + "; every reused miss filled, the others on the CPU)"
        if self.admit_useful and self.fill_reused:
            text += "; reused misses filled while the LRU slot was hit since its fill"
        if self.fill_reused_valued:
            uses = "B_H/B_P - 1" if self.host_rates == "alone" else "B_H'/B_P'"
            text += (f"; a reused miss filled only where its expected uses before eviction "
                     f"reach {uses} = {b_h / b_p - 1:.2f}")
        if self.fixed_us is None:
            return text + "; fixed costs unknown: no lone-miss rule)"
        f_p, f_h = self.fixed_us
        fewest = next((m for m in range(1, 129) if self.cpu_count(m) > 0), None)
        when = (f"the first CPU expert at {fewest} misses in a layer call"
                if fewest else "every admitted miss filled: the CPU branch never ends first; "
                "the misses the admission rule does not admit run on the CPU"
                if self.admission else "every miss filled: the CPU branch never ends first")
        return text + (f"; fixed costs F_P {f_p:.1f} us, F_H {f_h:.1f} us: lone-miss rule, "
                       f"{when})")
