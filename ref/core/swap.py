"""Where a request's KV goes when it must leave the device: recompute or swap.

Two decisions share one cost model:

**Preemption** (recompute or swap out). A victim's KV is either dropped and
recomputed when it resumes, or copied to the host pool and back. With ``L`` tokens of
KV, ``s`` bytes of K and V per token (all layers), a host link of ``W`` bytes/ms and a
fixed ``latency_ms`` per copy direction:

- swap costs two copies, ``t_swap(L) = 2 * (latency_ms + L * s / W)``, and holds
  ``ceil(L / block_size)`` host blocks meanwhile;
- recompute re-runs the prefill, ``t_recompute(L) = b * L``, with ``b`` the ms per
  prefill token of the same iteration model the scheduler and simulator use (example 2's
  ``a + b*P + c*D``); it is compute taken from the token budget of later steps.

``AUTO`` swaps exactly when ``t_swap(L) < t_recompute(L)`` and the host pool has room,
i.e. when the link beats compute per token (``2 * s / W < b``) and the context is past
the break-even length ``2 * latency_ms / (b - 2 * s / W)`` where the fixed copy latency
is paid off. Two things the linear model leaves out, on opposite sides: prefill
attention grows with ``L`` (recompute of long contexts is dearer than ``b * L``), and a
recompute may find the victim's full blocks still in the prefix cache (cheaper). A
fitted model that prices either can replace :meth:`SwapCost.recompute_ms`.

**Tool waits** (agent sessions, example 3's third trace). A paused turn keeps its KV on the
device for short waits (resuming then computes only the tool's tokens), moves it to the host
for longer ones (the device blocks serve others meanwhile), and drops it past a threshold
(host memory is finite too; the prefix cache may still hold its full blocks).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from refserve.core.cost import StepCost
from refserve.errors import InvalidArgument

if TYPE_CHECKING:
    from refserve.core.plan import StepPlan


class PreemptionMode(StrEnum):
    RECOMPUTE = "recompute"
    SWAP = "swap"  # swap whenever the host pool has room, else recompute
    AUTO = "auto"  # swap when it is predicted cheaper (see the module doc)


class KVRetention(StrEnum):
    """Where a paused (WAITING_TOOL) request's KV waits for the tool."""

    DEVICE = "device"
    HOST = "host"
    DROP = "drop"


@dataclass(frozen=True)
class SwapCost:
    """The figures the recompute-vs-swap rule needs.

    ``kv_bytes_per_token``: K and V of one token over all layers
    (``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``); ``link_gb_per_s``: host
    <-> device copy bandwidth (GB/s = bytes/ns); ``latency_ms``: fixed cost per copy
    direction; ``iteration``: the step-time model whose ``b`` prices recompute.
    """

    kv_bytes_per_token: int
    link_gb_per_s: float = 25.0
    latency_ms: float = 0.0
    iteration: StepCost = field(default_factory=StepCost)

    def __post_init__(self) -> None:
        if (
            isinstance(self.kv_bytes_per_token, bool)
            or not isinstance(self.kv_bytes_per_token, int)
            or self.kv_bytes_per_token < 1
        ):
            raise InvalidArgument(
                f"kv_bytes_per_token must be a positive int, got {self.kv_bytes_per_token!r}"
            )
        if not self.link_gb_per_s > 0:
            raise InvalidArgument(f"link_gb_per_s must be > 0, got {self.link_gb_per_s!r}")
        if not self.latency_ms >= 0:
            raise InvalidArgument(f"latency_ms must be >= 0, got {self.latency_ms!r}")

    def copy_ms(self, num_tokens: int) -> float:
        """One direction: ``num_tokens`` tokens of KV over the host link."""
        return self.latency_ms + num_tokens * self.kv_bytes_per_token / (self.link_gb_per_s * 1e6)

    def swap_ms(self, num_tokens: int) -> float:
        return 2 * self.copy_ms(num_tokens)

    def recompute_ms(self, num_tokens: int) -> float:
        return self.iteration.b * num_tokens

    def prefers_swap(self, num_tokens: int) -> bool:
        return num_tokens > 0 and self.swap_ms(num_tokens) < self.recompute_ms(num_tokens)

    def breakeven_tokens(self, limit: int = 1 << 22) -> int | None:
        """The shortest context for which swap wins, or None if none up to ``limit``."""
        lo, hi = 1, limit
        if not self.prefers_swap(hi):
            return None
        # swap - recompute is linear in L and >= 0 at L = 0, so once swap wins it keeps
        # winning: binary search for the first L where it does.
        while lo < hi:
            mid = (lo + hi) // 2
            if self.prefers_swap(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo


def preempt_by_swap(
    mode: PreemptionMode,
    num_stored: int,
    *,
    never_fits: bool,
    host_has_room: bool,
    swap_is_cheaper: bool,
) -> bool:
    """Whether a preemption victim with ``num_stored`` tokens of KV is swapped out
    (True) or dropped for recompute: the rule of the module doc (PROGRESS: a victim
    leaves the device either way; docs/ARCHITECTURE.md, "Verification practice").

    ``never_fits``: the victim's tokens exceed the device pool (it would never be swapped
    back in); ``host_has_room``: the host pool can hold its KV; ``swap_is_cheaper``:
    :meth:`SwapCost.prefers_swap`, read only by ``AUTO``. The contract is the rule as a
    table: nothing is swapped that cannot be (no KV, no host room, or never coming back);
    ``RECOMPUTE`` never swaps; ``SWAP`` swaps whenever it can; ``AUTO`` swaps exactly when
    it can and the swap is the cheaper.

    pre: num_stored >= 0
    post: not __return__ or (num_stored > 0 and host_has_room and not never_fits)
    post: mode is not PreemptionMode.RECOMPUTE or not __return__
    post: mode is not PreemptionMode.SWAP or __return__ == (num_stored > 0 and host_has_room and not never_fits)
    post: mode is not PreemptionMode.AUTO or __return__ == (num_stored > 0 and host_has_room and not never_fits and swap_is_cheaper)
    """  # noqa: E501 (CrossHair reads one condition per line)
    if mode is PreemptionMode.RECOMPUTE or not num_stored:
        return False
    if never_fits:
        return False  # it can never run again here: commit finishes it (capacity)
    if not host_has_room:
        return False
    if mode is PreemptionMode.AUTO:
        return swap_is_cheaper
    return True


@dataclass(frozen=True)
class RetentionPolicy:
    """Tool-wait retention by expected wait: device below ``device_max_wait_ms``, host
    below ``host_max_wait_ms``, dropped beyond (or when the host pool has no room)."""

    device_max_wait_ms: float = 1_000.0
    host_max_wait_ms: float = 60_000.0

    def __post_init__(self) -> None:
        if not 0 <= self.device_max_wait_ms <= self.host_max_wait_ms:
            raise InvalidArgument(
                "retention thresholds need 0 <= device_max_wait_ms <= host_max_wait_ms, got "
                f"{self.device_max_wait_ms!r} and {self.host_max_wait_ms!r}"
            )

    def choose(self, expected_wait_ms: float, *, host_available: bool) -> KVRetention:
        if not expected_wait_ms >= 0:
            raise InvalidArgument(f"expected_wait_ms must be >= 0, got {expected_wait_ms!r}")
        if expected_wait_ms < self.device_max_wait_ms:
            return KVRetention.DEVICE
        if expected_wait_ms < self.host_max_wait_ms and host_available:
            return KVRetention.HOST
        return KVRetention.DROP


@dataclass(frozen=True)
class SwapTraffic:
    """What a run moved over the host link (the "swapped bytes" of a report)."""

    num_swapped_out: int  # requests whose KV went to the host (victims and paused turns)
    num_swapped_in: int
    blocks_out: int
    blocks_in: int
    bytes_per_block: int

    @classmethod
    def of(cls, plans: Iterable[StepPlan], bytes_per_block: int) -> SwapTraffic:
        out = inn = blocks_out = blocks_in = 0
        for p in plans:
            out += len(p.swapped_out)
            inn += len(p.swapped_in)
            blocks_out += len(p.swap_out)
            blocks_in += len(p.swap_in)
        return cls(out, inn, blocks_out, blocks_in, bytes_per_block)

    @property
    def bytes_out(self) -> int:
        return self.blocks_out * self.bytes_per_block

    @property
    def bytes_in(self) -> int:
        return self.blocks_in * self.bytes_per_block

    def __str__(self) -> str:
        def size(n: int) -> str:
            return f"{n / 2**20:.1f} MiB" if self.bytes_per_block else "? bytes"

        return (
            f"swapped out {self.num_swapped_out} requests ({self.blocks_out} blocks, "
            f"{size(self.bytes_out)}), swapped in {self.num_swapped_in} "
            f"({self.blocks_in} blocks, {size(self.bytes_in)})"
        )
