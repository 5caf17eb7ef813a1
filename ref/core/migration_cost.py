"""Transfer or recompute: how a migrated request's KV reaches the destination
(docs/MIGRATION.md, "The cost rule").

With ``L`` tokens of KV the destination does not already hold (its prefix hit is
subtracted first: those tokens cost nothing either way), ``s`` bytes of K and V per token
(all layers), a link of ``W`` bytes/ms, a fixed ``latency_ms`` per transfer and the
destination's prefill cost of ``b`` ms per token (the ``b`` of the iteration model
``a + b*P + c*D``) of which a fraction ``idle`` is free:

- transfer costs ``t_transfer(L) = latency_ms + L * s / W``;
- recompute costs ``t_recompute(L) = b * L / idle``: the prefill runs in the
  destination's spare compute, so a busy destination (small ``idle``) makes it dearer.

``AUTO`` transfers exactly when ``t_transfer(L) <= t_recompute(L)``: when the link beats
compute per token (``s / W < b / idle``) and the context is past the break-even length
``latency_ms / (b / idle - s / W)`` that pays the fixed latency off. The rule and its
inputs are kept with the request (:class:`MigrationDecision`, in its metrics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from refserve.core.cost import StepCost
from refserve.errors import InvalidArgument
from refserve.values import is_int

#: The least idle fraction the rule divides by: a saturated destination is priced as
#: this busy, not infinitely (recompute stays finite and comparable).
MIN_IDLE = 1e-3


class KVMode(StrEnum):
    """How the KV of a migrated request reaches the destination."""

    TRANSFER = "transfer"  # copied over the link (inline in the ticket, or in chunks)
    RECOMPUTE = "recompute"  # not sent; the destination prefills it again
    AUTO = "auto"  # the cheaper of the two by :class:`MigrationCost`


@dataclass(frozen=True)
class MigrationDecision:
    """What the rule chose for one move of one request, and from what (its metrics)."""

    mode: KVMode
    kv_tokens: int  # KV length on the source
    hit_tokens: int  # of those, already cached on the destination
    transfer_ms: float
    recompute_ms: float
    link_gb_per_s: float
    latency_ms: float
    idle: float

    @property
    def moved_tokens(self) -> int:
        """Tokens whose KV travelled (0 for a recompute)."""
        return self.kv_tokens - self.hit_tokens if self.mode is KVMode.TRANSFER else 0


@dataclass(frozen=True)
class MigrationCost:
    """The figures the transfer-vs-recompute rule needs (module doc)."""

    kv_bytes_per_token: int
    link_gb_per_s: float = 25.0
    latency_ms: float = 0.0
    iteration: StepCost = field(default_factory=StepCost)

    def __post_init__(self) -> None:
        n = self.kv_bytes_per_token
        if not is_int(n) or n < 1:
            raise InvalidArgument(f"kv_bytes_per_token must be a positive int, got {n!r}")
        if not (self.link_gb_per_s > 0 and math.isfinite(self.link_gb_per_s)):
            raise InvalidArgument(f"link_gb_per_s must be > 0, got {self.link_gb_per_s!r}")
        if not (self.latency_ms >= 0 and math.isfinite(self.latency_ms)):
            raise InvalidArgument(f"latency_ms must be >= 0, got {self.latency_ms!r}")

    def transfer_ms(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.latency_ms + num_tokens * self.kv_bytes_per_token / (self.link_gb_per_s * 1e6)

    def recompute_ms(self, num_tokens: int, idle: float = 1.0) -> float:
        return self.iteration.b * num_tokens / max(idle, MIN_IDLE)

    def decide(
        self, mode: KVMode | str, kv_tokens: int, hit_tokens: int = 0, idle: float = 1.0
    ) -> MigrationDecision:
        """The mode for a request with ``kv_tokens`` of KV, ``hit_tokens`` of them cached on
        the destination; ``AUTO`` resolves by the rule, the others are kept as asked."""
        if not 0 <= hit_tokens <= kv_tokens:
            raise InvalidArgument(f"hit_tokens must be in [0, {kv_tokens}], got {hit_tokens}")
        if not 0 <= idle <= 1:
            raise InvalidArgument(f"idle must be in [0, 1], got {idle!r}")
        missing = kv_tokens - hit_tokens
        t_transfer = self.transfer_ms(missing)
        t_recompute = self.recompute_ms(missing, idle)
        try:
            chosen = KVMode(mode)
        except ValueError:
            allowed = ", ".join(m.value for m in KVMode)
            raise InvalidArgument(f"kv mode must be one of {allowed}, got {mode!r}") from None
        if chosen is KVMode.AUTO:
            chosen = KVMode.TRANSFER if t_transfer <= t_recompute else KVMode.RECOMPUTE
        return MigrationDecision(
            chosen,
            kv_tokens,
            hit_tokens,
            t_transfer,
            t_recompute,
            self.link_gb_per_s,
            self.latency_ms,
            idle,
        )

    def breakeven_tokens(self, idle: float = 1.0, limit: int = 1 << 22) -> int | None:
        """The shortest missing context for which transfer wins, None if none to ``limit``."""
        if self.transfer_ms(limit) > self.recompute_ms(limit, idle):
            return None
        lo, hi = 1, limit
        # transfer - recompute is linear in L past 0: once transfer wins it keeps winning.
        while lo < hi:
            mid = (lo + hi) // 2
            if self.transfer_ms(mid) <= self.recompute_ms(mid, idle):
                hi = mid
            else:
                lo = mid + 1
        return lo
