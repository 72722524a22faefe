"""The CPU share of a streamed prefill: how many of a layer's non-resident experts the C
executor runs instead of streaming them (bookkeeping only; ``prefill_cpu.py`` moves the data).

Beyond the paper (§3.1 streams every non-resident expert of a prefill layer over PCIe): a
streamed layer is bound by its PCIe time, ``m * S / B_P`` for ``m`` non-resident experts of
``S`` bytes, while the CPU, which holds every expert, idles. The CPU share sends ``c`` of the
``m`` experts to the C executor and streams the rest, so the layer takes about
``max((m - c) * p, c * h)`` with ``p = S / B_P`` and ``h`` the CPU's time per expert. The
balance ``c * h = (m - c) * p`` gives ``c = round(m * p / (p + h))``, q*'s closed form with
the CPU's prefill cost in place of its decode bandwidth. The CPU's time per expert grows with
the tokens each expert gets, ``t = rows * k / E`` (the call's rows routed uniformly), so long
prefill chunks give the CPU little and short re-prefills (agent turns) much:

    h(t) = S / (B_H - B_P) + g * t

``S / (B_H - B_P)`` is Eq. 3's read time with PCIe fills drawing host-memory bandwidth at the
same time, and ``g`` the executor's compute time per (token, expert) item, measured on the
model's expert shape at start (``policy.rates.measure_executor_tokens``). While serving, ``p``
and ``g`` follow what the streamed copies and the CPU runs take (``calibrated``): the
streamed copies run at the copy engine's rate rather than the fill kernels' B_P, and the
executor computes slower beside the PCIe traffic than alone. Nothing is tuned. Which
experts go to the CPU is decided when a layer's copy is issued, before its routing is known:
the last ``c`` non-resident experts by index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Where B_H <= B_P the CPU has no residual bandwidth beside the fills (Eq. 3): no CPU share.
UNREACHABLE_US = 1e30


@dataclass(frozen=True)
class PrefillCpuRule:
    """How many of a streamed layer's non-resident experts run on the CPU.

    Attributes:
        share: a fixed fraction of the non-resident experts (``--freetoken-prefill-cpu F``),
            or None for the balance rule.
        p_us: one expert's PCIe time, ``S / B_P`` (us).
        h0_us: one expert's CPU read time beside the fills, ``S / (B_H - B_P)`` (us).
        g_us: the executor's compute time per (token, expert) item (us).
        top_k, num_experts: k and E, for the tokens per expert of a call.
    """

    share: Optional[float]
    p_us: float = 0.0
    h0_us: float = UNREACHABLE_US
    g_us: float = 0.0
    top_k: int = 1
    num_experts: int = 1

    @classmethod
    def balanced(cls, expert_bytes: int, b_p: float, b_h: float, g_us: float, top_k: int,
                 num_experts: int) -> "PrefillCpuRule":
        """The balance rule from measured B_P, B_H (GB/s) and g (us per item).

        Raises:
            ValueError: a non-positive bandwidth or a negative g.
        """
        if b_p <= 0 or b_h <= 0 or g_us < 0:
            raise ValueError(f"need B_P, B_H > 0 and g >= 0, got {b_p}, {b_h}, {g_us}")
        p = expert_bytes / (b_p * 1e3)  # bytes / (GB/s) in us
        h0 = expert_bytes / ((b_h - b_p) * 1e3) if b_h > b_p else UNREACHABLE_US
        return cls(None, p, h0, g_us, top_k, num_experts)

    def tokens_per_expert(self, rows: int) -> float:
        """Expected items per expert of a call over ``rows`` rows: ``rows * k / E``."""
        return rows * self.top_k / self.num_experts

    def cpu_count(self, missing: int, rows: int) -> int:
        """How many of a layer's ``missing`` non-resident experts the CPU runs in a streamed
        call over ``rows`` rows (0 <= result <= missing)."""
        if missing <= 0:
            return 0
        if self.share is not None:
            return min(missing, int(round(missing * self.share)))
        h = self.h0_us + self.g_us * self.tokens_per_expert(rows)
        if h >= UNREACHABLE_US:
            return 0
        return min(missing, int(round(missing * self.p_us / (self.p_us + h))))

    def calibrated(self, copies, runs, weight: float = 0.5) -> "PrefillCpuRule":
        """The balance rule moved towards what serving measured (a fixed share is kept):
        ``p`` towards the streamed copies' time per expert, ``g`` towards
        ``(run time per expert - h0) / t`` of the CPU runs with ``t >= 1``; each the mean of
        the observations (weighted by experts), mixed in with ``weight``.

        Args:
            copies: ``(us, experts)`` of finished layer copies.
            runs: ``(us per expert, tokens per expert, experts)`` of finished CPU runs.
        """
        if self.share is not None:
            return self
        p, g = self.p_us, self.g_us
        n = sum(e for _, e in copies)
        if n:
            p = (1 - weight) * p + weight * sum(us for us, _ in copies) / n
        runs = [(us, t, e) for us, t, e in runs if t >= 1.0]
        n = sum(e for _, _, e in runs)
        if n and self.h0_us < UNREACHABLE_US:
            obs = sum(max(0.0, (us - self.h0_us) / t) * e for us, t, e in runs) / n
            g = (1 - weight) * g + weight * obs
        return PrefillCpuRule(None, p, self.h0_us, g, self.top_k, self.num_experts)

    def describe(self) -> str:
        if self.share is not None:
            return f"{self.share:g} of each streamed layer's non-resident experts"
        if self.h0_us >= UNREACHABLE_US:
            return "none (B_H <= B_P: no host bandwidth left beside the fills)"
        return (f"balance rule (p {self.p_us:.1f} us, CPU {self.h0_us:.1f} us + "
                f"{self.g_us:.2f} us per token, per expert)")
