"""Scheduler configuration: the three separate limits and the admission rule.

Token budget (``max_num_batched_tokens``) is compute per step, ``max_num_seqs`` bounds
participants and ``num_blocks`` bounds memory (docs/ARCHITECTURE.md, "Vocabulary": three
limits, none of which stands in for another).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from refserve.core.cost import StepCost
from refserve.core.mlfq_settings import MlfqSettings
from refserve.core.swap import PreemptionMode, RetentionPolicy, SwapCost
from refserve.spec.groups import GroupKind, KVGroup

__all__ = ["Admission", "MlfqSettings", "PolicyName", "SchedulerConfig"]
from refserve.errors import InvalidArgument
from refserve.values import is_int, is_number


class Admission(StrEnum):
    """How much KV a waiting request must be able to get before it is admitted.

    ``first_chunk`` checks only the chunk scheduled now (vLLM v1); ``prompt`` the whole
    remaining prompt; ``sequence`` the prompt plus ``max_tokens`` outputs (example 2e of
    docs/ARCHITECTURE.md; the admit-fill-preempt thrash). Each looks at the blocks free
    now: the growth the running requests are still owed is not held back for them, so
    ``sequence`` makes preemption rarer but does not rule it out (docs/kv_layouts shows
    it preempting at short prompts).
    """

    FIRST_CHUNK = "first_chunk"
    PROMPT = "prompt"
    SEQUENCE = "sequence"


class PolicyName(StrEnum):
    DECODE_FIRST = "decode-first"
    STATIC = "static"
    TENANT_FAIR = "tenant-fair"
    MLFQ = "mlfq"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 1 << 20
    enable_prefix_caching: bool = True
    # Publish the prefix cache's changes (ref/kv/events.py) for a router that routes by
    # prefix hits (docs/ARCHITECTURE.md, "Cache events"); off, nothing is recorded.
    cache_events: bool = False
    enable_chunked_prefill: bool = True
    # Chunks that do not finish a prompt end on a block boundary (example 3: 1008 of 1021).
    align_chunks_to_blocks: bool = False
    admission: Admission = Admission.FIRST_CHUNK
    # Blocks kept free at admission for running requests' decode growth.
    watermark_blocks: int = 0
    # Share of the token budget held for a prefill that has waited longer than
    # ``prefill_reserve_after_steps`` steps (example 2d's starvation fix); 0 disables it.
    prefill_reserve_tokens: int = 0
    prefill_reserve_after_steps: int = 8
    policy: PolicyName = PolicyName.DECODE_FIRST
    # Aging: a waiting request's effective priority improves by one level every
    # ``aging_steps`` steps it waits (0: off). See ref/core/policy.py for the ordering bound.
    aging_steps: int = 0
    # SLO-aware chunk sizing (example 3 of docs/ARCHITECTURE.md): with both set, the step's
    # prefill tokens are capped so ``step_cost`` predicts the step ends before the
    # tightest running decode's next-token deadline (its last token time + ``tbt_slo_ms``).
    tbt_slo_ms: float | None = None
    step_cost: StepCost | None = None
    # Admission control: at most ``max_waiting`` queued requests (add_request raises
    # QueueFull beyond it), and a request still waiting for its first admission
    # ``queue_timeout_ms`` after arrival finishes with reason ``timeout``.
    max_waiting: int | None = None
    queue_timeout_ms: float | None = None
    # Tenant fairness (policy "tenant-fair"): deficit round robin over prefill tokens.
    # Each step a backlogged tenant earns weight x quantum tokens of credit (weight 1 if
    # not listed); the tenant with the most credit is admitted first. Optionally at most
    # ``tenant_max_running`` running requests per tenant.
    tenant_weights: tuple[tuple[str, float], ...] = ()
    tenant_quantum_tokens: int = 64
    tenant_max_running: int | None = None
    # Preemption by swap (ref/core/swap.py): a host pool of ``num_host_blocks`` blocks;
    # ``swap`` swaps every victim the host pool can hold, ``auto`` only those for which
    # ``swap_cost`` predicts the round trip is cheaper than recomputing.
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    num_host_blocks: int = 0
    swap_cost: SwapCost | None = None
    # Where a paused agent turn's KV waits when ``pause`` is not told (by expected wait).
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    # Speculative decoding (docs/SPECULATIVE.md): the most draft tokens one decoding
    # request may have verified in a step (``Scheduler.propose``); 0 turns it off.
    num_speculative_tokens: int = 0
    # The skip-join multi-level feedback queue's knobs (policy "mlfq"; ref/core/mlfq.py).
    mlfq: MlfqSettings = field(default_factory=MlfqSettings)
    # The model's KV layer groups (spec/groups.py, docs/HYBRID_KV.md): () is one full
    # attention group, the plain pool; a layout with window groups keeps a table per
    # group over one shared pool (ref/kv/groups.py), its first group full attention.
    kv_groups: tuple[KVGroup, ...] = ()

    @property
    def pool_options(self) -> dict[str, bool]:
        """The block pool's switches (``BlockPool``'s keyword arguments)."""
        return {
            "enable_prefix_caching": self.enable_prefix_caching,
            "cache_events": self.cache_events,
        }

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "block_size",
            "num_blocks",
            "max_model_len",
        ):
            _positive(name, getattr(self, name))
        for name in (
            "watermark_blocks",
            "prefill_reserve_tokens",
            "prefill_reserve_after_steps",
            "num_host_blocks",
            "num_speculative_tokens",
        ):
            _non_negative(name, getattr(self, name))
        if self.prefill_reserve_tokens >= self.max_num_batched_tokens:
            raise InvalidArgument(
                f"prefill_reserve_tokens ({self.prefill_reserve_tokens}) must be below "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        if self.watermark_blocks >= self.num_blocks:
            raise InvalidArgument(
                f"watermark_blocks ({self.watermark_blocks}) must be below "
                f"num_blocks ({self.num_blocks})"
            )
        _non_negative("aging_steps", self.aging_steps)
        _positive("tenant_quantum_tokens", self.tenant_quantum_tokens)
        if self.tenant_max_running is not None:
            _positive("tenant_max_running", self.tenant_max_running)
        for tenant, weight in self.tenant_weights:
            if not isinstance(tenant, str) or isinstance(weight, bool) or not weight > 0:
                raise InvalidArgument(
                    f"tenant_weights needs (tenant, weight > 0) pairs, got ({tenant!r}, {weight!r})"
                )
        if self.max_waiting is not None:
            _positive("max_waiting", self.max_waiting)
        for name in ("tbt_slo_ms", "queue_timeout_ms"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or not value > 0):
                raise InvalidArgument(f"{name} must be a positive number of ms, got {value!r}")
        if (self.tbt_slo_ms is None) != (self.step_cost is None):
            raise InvalidArgument(
                "tbt_slo_ms and step_cost go together: SLO-aware chunking needs both"
            )
        if self.step_cost is not None and not self.step_cost.b > 0:
            raise InvalidArgument(
                f"step_cost must charge prefill tokens (b > 0), got {self.step_cost}"
            )
        if self.align_chunks_to_blocks and self.max_num_batched_tokens < self.block_size:
            # An aligned partial chunk is a whole number of blocks: with a budget below one
            # block every partial chunk rounds down to 0 tokens and the prompt never runs.
            raise InvalidArgument(
                f"align_chunks_to_blocks needs max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) >= block_size ({self.block_size})"
            )
        # Store the enum members: the scheduler compares with ``is``, so a plain string
        # such as "static" would otherwise silently select the default behaviour.
        for name, kind in (
            ("admission", Admission),
            ("policy", PolicyName),
            ("preemption_mode", PreemptionMode),
        ):
            value = getattr(self, name)
            try:
                member = kind(value)
            except ValueError:
                allowed = ", ".join(m.value for m in kind)
                raise InvalidArgument(f"{name} must be one of {allowed}, got {value!r}") from None
            object.__setattr__(self, name, member)
        if not isinstance(self.mlfq, MlfqSettings):
            raise InvalidArgument(f"mlfq must be MlfqSettings, got {self.mlfq!r}")
        if self.preemption_mode is not PreemptionMode.RECOMPUTE and not self.num_host_blocks:
            raise InvalidArgument(
                f"preemption_mode {self.preemption_mode.value!r} needs num_host_blocks > 0"
            )
        self._check_groups()
        if self.preemption_mode is PreemptionMode.AUTO and self.swap_cost is None:
            raise InvalidArgument(
                "preemption_mode 'auto' needs swap_cost (refserve.core.swap.SwapCost)"
            )

    def _check_groups(self) -> None:
        groups = self.kv_groups
        if not isinstance(groups, tuple) or not all(isinstance(g, KVGroup) for g in groups):
            raise InvalidArgument(f"kv_groups must be a tuple of KVGroup, got {groups!r}")
        if groups and groups[0].kind is not GroupKind.FULL:
            raise InvalidArgument(f"kv_groups[0] must be a full attention group, got {groups[0]!r}")

    @property
    def grouped(self) -> bool:
        """A layout of several layer groups: the pool keeps a table per group."""
        return len(self.kv_groups) > 1

    @property
    def max_len(self) -> int:
        """Longest sequence (prompt + outputs) a request may reach.

        Without chunked prefill a prompt, and a preempted request's recompute of prompt
        plus outputs, must fit in one step's token budget or it never runs again, so the
        budget caps the length (vLLM does the same).
        """
        if self.enable_chunked_prefill:
            return self.max_model_len
        return min(self.max_model_len, self.max_num_batched_tokens)


def _positive(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise InvalidArgument(f"{name} must be a positive int, got {value!r}")


def _non_negative(name: str, value: object) -> None:
    if not is_int(value) or value < 0:
        raise InvalidArgument(f"{name} must be a non-negative int, got {value!r}")
