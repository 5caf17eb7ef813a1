"""The iteration cost model of seed 002: a step takes ``a + b*P + c*D (+ e*K)`` ms.

P is the number of prefill tokens in the step, D the number of decode requests and K the
KV tokens the decodes read (optional). Seed 002 uses ``2 + 0.5P + D``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ref.errors import InvalidArgument

_TERM = re.compile(r"^(?P<coef>\d+(?:\.\d+)?)?\*?(?P<var>[PDK])?$")


@dataclass(frozen=True)
class CostModel:
    a: float = 2.0
    b: float = 0.5
    c: float = 1.0
    e: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "e"):
            if getattr(self, name) < 0:
                raise InvalidArgument(
                    f"cost model coefficient {name} must be >= 0, got {getattr(self, name)}"
                )

    def step_ms(self, num_prefill_tokens: int, num_decodes: int, num_kv_read: int = 0) -> float:
        return self.a + self.b * num_prefill_tokens + self.c * num_decodes + self.e * num_kv_read

    @classmethod
    def parse(cls, text: str) -> CostModel:
        """Parse ``'2+0.5P+D'`` (terms in any order; K is optional)."""
        coef = {"": 0.0, "P": 0.0, "D": 0.0, "K": 0.0}
        compact = text.replace(" ", "")
        if not compact:
            raise InvalidArgument("cost model is empty; expected something like '2+0.5P+D'")
        for term in compact.split("+"):
            m = _TERM.match(term)
            if not term or m is None or (m.group("coef") is None and m.group("var") is None):
                raise InvalidArgument(
                    f"cost model {text!r}: cannot read term {term!r}; expected like 0.5P"
                )
            var = m.group("var") or ""
            coef[var] += float(m.group("coef")) if m.group("coef") is not None else 1.0
        return cls(coef[""], coef["P"], coef["D"], coef["K"])

    def __str__(self) -> str:
        text = f"{self.a:g}+{self.b:g}P+{self.c:g}D"
        return text + (f"+{self.e:g}K" if self.e else "")
