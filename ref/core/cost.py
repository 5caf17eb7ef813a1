"""The iteration cost model of example 2: a step takes ``a + b*P + c*D (+ e*K)`` ms.

P is the number of prefill tokens in the step, D the number of decode requests and K the
KV tokens the decodes read (optional). ``f`` (optional, ``bench-serve --fit``'s richer
model) is a fixed cost more for a step that computes any prefill token: a batch with a
prefill builds its inputs and attention differently from a decode-only one. ``g``
(optional) is not the step's: it is the serving loop's time after a step before the
next one can start (handing the outputs over); the simulators add it to the clock after
each step, after the step's tokens are stamped. Example 2 (docs/ARCHITECTURE.md) uses
``2 + 0.5P + D``. Every coefficient
is a finite number in [0, 1e6] ms (``MAX_COEFFICIENT_MS``): a 400-digit one would become
``inf`` and every time after it ``inf`` or ``NaN``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from refserve.errors import InvalidArgument

_TERM = re.compile(r"^(?P<coef>\d+(?:\.\d+)?)?\*?(?P<var>[PDK])?$")
#: The largest coefficient (ms per step, per prefill token, per decode, per KV token read).
#: A million ms per unit is far past any real engine and keeps a run's clock finite.
MAX_COEFFICIENT_MS = 1e6


@dataclass(frozen=True)
class StepCost:
    a: float = 2.0
    b: float = 0.5
    c: float = 1.0
    e: float = 0.0
    f: float = 0.0
    g: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "e", "f", "g"):
            value = getattr(self, name)
            if value < 0:
                raise InvalidArgument(f"cost model coefficient {name} must be >= 0, got {value}")
            # ``not value <= max`` also refuses NaN, which every comparison fails.
            if not value <= MAX_COEFFICIENT_MS:
                raise InvalidArgument(
                    f"cost model coefficient {name} must be a finite number <= "
                    f"{MAX_COEFFICIENT_MS:g} ms, got {value}"
                )

    def step_ms(self, num_prefill_tokens: int, num_decodes: int, num_kv_read: int = 0) -> float:
        ms = self.a + self.b * num_prefill_tokens + self.c * num_decodes + self.e * num_kv_read
        return ms + self.f if num_prefill_tokens else ms

    def prefill_room(self, budget_ms: float, num_decodes: int, num_kv_read: int = 0) -> int:
        """The most prefill tokens a step beside ``num_decodes`` decodes may take and end
        within ``budget_ms``: ``floor((budget_ms - (a + c*D + e*K)) / b)``, negative when
        the decodes alone overrun it. Needs ``b > 0`` (the SLO-aware chunk rule's)."""
        assert self.b > 0, "a prefill token costs something"
        return math.floor((budget_ms - self.step_ms(0, num_decodes, num_kv_read)) / self.b)

    @classmethod
    def parse(cls, text: str) -> StepCost:
        """Parse ``'2+0.5P+D'`` (terms in any order; K is optional)."""
        coef = {"": 0.0, "P": 0.0, "D": 0.0, "K": 0.0}
        compact = text.replace(" ", "")
        if not compact:
            raise InvalidArgument("cost model is empty; expected something like '2+0.5P+D'")
        for term in compact.split("+"):
            m = _TERM.match(term)
            if not term or m is None or (m.group("coef") is None and m.group("var") is None):
                raise InvalidArgument(
                    f"cost model {_clip(text)!r}: cannot read term {_clip(term)!r}; "
                    "expected like 0.5P"
                )
            var = m.group("var") or ""
            value = float(m.group("coef")) if m.group("coef") is not None else 1.0
            if not value <= MAX_COEFFICIENT_MS:  # 400 digits parse to inf
                raise InvalidArgument(
                    f"cost model: term {_clip(term)!r} is above {MAX_COEFFICIENT_MS:g} ms, the "
                    "limit of a coefficient"
                )
            coef[var] += value
        return cls(coef[""], coef["P"], coef["D"], coef["K"])

    def __str__(self) -> str:
        text = f"{self.a:g}+{self.b:g}P+{self.c:g}D"
        text += f"+{self.e:g}K" if self.e else ""
        text += f" (+{self.f:g} when P>0)" if self.f else ""
        return text + (f", then {self.g:g} between steps" if self.g else "")


def _clip(text: str, limit: int = 40) -> str:
    """Hostile input can be thousands of characters; a message shows its ends."""
    return text if len(text) <= limit else f"{text[:16]}...{text[-16:]} ({len(text)} chars)"


def fit_step_cost(
    durations_ms: Sequence[float],
    prefill_tokens: Sequence[int],
    decodes: Sequence[int],
    kv_read: Sequence[int] | None = None,
) -> StepCost:
    """Least-squares fit of ``t = a + b*P + c*D (+ e*K)`` to recorded steps.

    Feed it the iterations of a real engine run (``StepRecord.end_ms - start_ms``,
    ``num_prefill_tokens``, ``num_decodes``) to get the iteration-latency model that
    SLO-aware chunk sizing uses. Coefficients are clipped at 0 (a negative cost per token
    is noise, not physics). Raises if the steps cannot determine the model.
    """
    n = len(durations_ms)
    cols: list[Sequence[float]] = [[1.0] * n, prefill_tokens, decodes]
    if kv_read is not None:
        cols.append(kv_read)
    if any(len(c) != n for c in cols):
        raise InvalidArgument("fit_step_cost: every sequence needs one entry per step")
    x = np.array(list(zip(*cols, strict=True)), dtype=np.float64)
    if n < len(cols) or int(np.linalg.matrix_rank(x)) < len(cols):
        raise InvalidArgument(
            f"fit_step_cost: {n} steps do not determine {len(cols)} coefficients "
            "(vary the prefill tokens and decode counts across steps)"
        )
    y = np.array(durations_ms, dtype=np.float64)
    # Full column rank (checked above), so the minimum-norm solution is the only one.
    solution = np.linalg.lstsq(x, y, rcond=None)[0]
    coef = np.maximum(solution, 0.0).tolist()
    return StepCost(coef[0], coef[1], coef[2], coef[3] if kv_read is not None else 0.0)
