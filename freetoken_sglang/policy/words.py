"""A decode miss policy in its flags' words: what ``--freetoken-miss-policy``, the rule flags
(``config.RULE_WORDS``) and ``POST /freetoken/cache`` say, and the ``MissPolicy`` they make."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from freetoken_sglang.config import RULE_WORDS
from freetoken_sglang.policy.miss import POLICIES, MissPolicy

if TYPE_CHECKING:
    from freetoken_sglang.policy.rates import Bandwidth


@dataclass(frozen=True)
class PolicyWords:
    """A decode miss policy in its flags' words (``--freetoken-miss-policy`` and the
    ``RULE_WORDS`` flags; ``POST /freetoken/cache``'s keys of the same names); None: not given.

    ``over`` completes a change asked for while serving, ``policy`` builds the
    ``MissPolicy``, and ``MissPolicy.words`` gives a policy's words back.

    Raises:
        ValueError: a word its flag does not list.
    """

    miss_policy: Optional[str] = None
    admission: Optional[str] = None
    fill_reused: Optional[str] = None
    return_rule: Optional[str] = None
    late_fill: Optional[str] = None
    host_rates: Optional[str] = None

    def __post_init__(self):
        if self.miss_policy is not None and self.miss_policy not in POLICIES:
            raise ValueError(f"miss policy must be one of {POLICIES}, got {self.miss_policy!r}")
        for key, words in RULE_WORDS.items():
            word = getattr(self, key)
            if word is not None and word not in words:
                raise ValueError(f"{key} must be one of {words}, got {word!r}")

    @property
    def given(self) -> bool:
        """Whether any word is given."""
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))

    def over(self, current: "MissPolicy") -> "PolicyWords":
        """Every word, for a change of ``current`` while serving. Given words win. Without
        a ``miss_policy``, the others are ``current``'s (a rule given alone changes the
        current policy's rules); with one, they are their flags' defaults (``RULE_WORDS``'
        first)."""
        base = current.words if self.miss_policy is None else PolicyWords(self.miss_policy)
        return PolicyWords(**{
            f.name: next(w for w in (getattr(self, f.name), getattr(base, f.name),
                                     RULE_WORDS.get(f.name, (None,))[0]) if w is not None)
            for f in dataclasses.fields(self)})

    def policy(self, bandwidth: Optional["Bandwidth"] = None,
               expert_bytes: int = 0) -> "MissPolicy":
        """The ``MissPolicy`` of these words (``over``'s, or every word given).

        Args:
            bandwidth: ``rates.Bandwidth``, needed by ``qstar``: its split rates for
                ``host_rates`` (``Bandwidth.split_rates``) and its fixed costs.
            expert_bytes: S, one expert's bytes in the pool (with the fixed costs).

        Raises:
            ValueError: a word not given, ``qstar`` without ``bandwidth``, the host rates
                beside each other that ``bandwidth`` lacks, or rules ``MissPolicy`` refuses.
        """
        missing = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is None]
        if missing:
            raise ValueError(f"a miss policy needs every word: {missing} not given")
        rules = dict(
            admission=self.admission != "off", admit_useful=self.admission == "useful",
            fill_reused=self.fill_reused != "off",
            fill_reused_valued=self.fill_reused == "valued",
            return_rule=self.return_rule == "on", late_fill=self.late_fill != "off",
            late_all=self.late_fill == "all", host_rates=self.host_rates)
        if self.miss_policy != "qstar":
            return MissPolicy(self.miss_policy, **rules)
        if bandwidth is None:
            raise ValueError("the qstar miss policy needs B_P and B_H (policy.rates.Bandwidth)")
        return MissPolicy("qstar", bandwidth.split_rates(self.host_rates), bandwidth.fixed_us,
                          expert_bytes, **rules)
