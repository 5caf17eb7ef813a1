"""The scheduling policies ``refserve compare`` sets side by side, and the SLOs it judges
them by (docs/ARCHITECTURE.md, example 3).

A policy is a :class:`NamedPolicy`: a name, a description and a function that turns the
comparison's base :class:`~refserve.core.config.SchedulerConfig` into that policy's config.
Add one by appending to :data:`POLICIES`. A policy that needs a SchedulerConfig field
this checkout lacks is skipped and named in the report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from refserve.core.config import PolicyName, SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.mlfq_settings import MlfqSettings
from refserve.core.request_metrics import RequestMetrics
from refserve.core.swap import SwapCost
from refserve.sim.simulator import SimSpeculation
from refserve.spec.arith import full_blocks

#: Drafts per decoding request per step for the speculative policies.
SPECULATIVE_TOKENS = 4


#: K and V of one real token of a 7B fp16 model (32 layers x 32 heads x 128 x 2 x 2 bytes),
#: and the host link the MLFQ policies swap over (PCIe 4 x16-like).
MLFQ_KV_BYTES_PER_TOKEN = 524_288
MLFQ_LINK_GB_PER_S = 25.0

#: The reference batch of the derived SLOs: a decode-only step of this many decodes.
D_REF = 32
#: TBT SLO = this many decode-only steps of the reference batch: a multiple of the cost
#: model's step, so the SLO follows the model instead of being typed in milliseconds.
TBT_MULTIPLE = 3.0
#: TTFT allowance per prompt token = this many times the cost model's prefill time.
TTFT_PREFILL_MULTIPLE = 2.0


@dataclass(frozen=True)
class Slo:
    """Per-request service level: both must hold for a request to count as goodput.

    The defaults are :meth:`of` the default cost model ``2 + 0.5P + D``."""

    ttft_base_ms: float = 102.0
    ttft_per_token_ms: float = 1.0
    tbt_ms: float = 102.0

    @staticmethod
    def of(cost: StepCost) -> Slo:
        """The SLOs derived from the cost model ``a + b*P + c*D`` (refserve.report.compare,
        "SLOs"): TBT = ``TBT_MULTIPLE`` decode-only steps of ``D_REF`` decodes; TTFT =
        the TBT SLO + ``TTFT_PREFILL_MULTIPLE`` x the prompt's own prefill time."""
        tbt = TBT_MULTIPLE * (cost.a + cost.c * D_REF)
        return Slo(tbt, TTFT_PREFILL_MULTIPLE * cost.b, tbt)

    def budget(self, cost: StepCost, block_size: int) -> int:
        """The largest multiple of ``block_size`` whose mixed step with ``D_REF`` decodes,
        ``a + b*B + c*D_REF``, stays within the TBT SLO (at least one block)."""
        room = self.tbt_ms - cost.a - cost.c * D_REF
        if cost.b <= 0:
            return 1 << 16
        return max(block_size, full_blocks(int(max(room, 0.0) / cost.b), block_size) * block_size)

    def ttft_limit_ms(self, num_prompt_tokens: int) -> float:
        return self.ttft_base_ms + self.ttft_per_token_ms * num_prompt_tokens

    def met(self, m: RequestMetrics) -> bool:
        """Finished normally, first token in time, and no gap between tokens too long."""
        if m.finish_reason not in ("stop", "length"):
            return False
        return self.ttft_met(m) and self.tbt_met(m)

    def ttft_met(self, m: RequestMetrics) -> bool:
        return m.ttft_ms is not None and m.ttft_ms <= self.ttft_limit_ms(m.num_prompt_tokens)

    def tbt_met(self, m: RequestMetrics) -> bool:
        return all(gap <= self.tbt_ms for gap in m.itl_ms)


@dataclass(frozen=True)
class PolicyContext:
    """What a policy's configuration may depend on besides the base config: the longest
    sequence of the workload (``max_len`` tokens), the SLOs, the simulator's step cost,
    and the comparison's scale (one simulated token stands for ``scale`` real ones)."""

    max_len: int
    slo: Slo
    cost: StepCost
    scale: float = 1.0


Configure = Callable[[SchedulerConfig, PolicyContext], SchedulerConfig]


@dataclass(frozen=True)
class NamedPolicy:
    """A scheduler configuration under a name.

    ``configure(base, ctx)`` returns the config for the workload and simulator that
    ``ctx`` describes (:class:`PolicyContext`).
    ``requires`` names SchedulerConfig fields the policy needs; without them it is
    skipped (and the report says so).
    """

    name: str
    description: str
    configure: Configure
    requires: tuple[str, ...] = ()
    # Speculative decoding's acceptance model on the simulator, for a policy that sets
    # num_speculative_tokens (docs/SPECULATIVE.md, "Simulator").
    speculation: SimSpeculation | None = None

    def available(self) -> bool:
        have = {f.name for f in dataclasses.fields(SchedulerConfig)}
        return all(r in have for r in self.requires)


def _fcfs(base: SchedulerConfig, ctx: PolicyContext) -> SchedulerConfig:
    # Without chunking a prompt must fit in one step: the budget grows to the longest
    # sequence, as vLLM sets max_num_batched_tokens = max_model_len without chunking.
    return dataclasses.replace(
        base,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        max_num_batched_tokens=max(base.max_num_batched_tokens, ctx.max_len + 1),
    )


def _static(base: SchedulerConfig, ctx: PolicyContext) -> SchedulerConfig:
    return dataclasses.replace(_fcfs(base, ctx), policy=PolicyName.STATIC)


def _chunked(base: SchedulerConfig, ctx: PolicyContext) -> SchedulerConfig:
    return dataclasses.replace(base, enable_chunked_prefill=True, enable_prefix_caching=False)


def _budget_times(factor: int, inner: Configure) -> Configure:
    """``inner`` with ``factor`` x the base token budget: the budget as a swept parameter."""

    def configure(base: SchedulerConfig, ctx: PolicyContext) -> SchedulerConfig:
        wide = dataclasses.replace(
            base, max_num_batched_tokens=base.max_num_batched_tokens * factor
        )
        return inner(wide, ctx)

    return configure


def _prefix_aware(base: SchedulerConfig, ctx: PolicyContext) -> SchedulerConfig:
    return dataclasses.replace(base, enable_chunked_prefill=True, enable_prefix_caching=True)


def _reserve(base: SchedulerConfig, ctx: PolicyContext) -> SchedulerConfig:
    return dataclasses.replace(
        _prefix_aware(base, ctx),
        prefill_reserve_tokens=max(1, base.max_num_batched_tokens // 8),
    )


def _slo_aware(base: SchedulerConfig, ctx: PolicyContext) -> SchedulerConfig:
    # The simulator's own cost model is the iteration model (in the real engine it would
    # be fitted from recorded steps: refserve.core.cost.fit_step_cost).
    return dataclasses.replace(
        _prefix_aware(base, ctx), tbt_slo_ms=ctx.slo.tbt_ms, step_cost=ctx.cost
    )


def _speculative(base: SchedulerConfig, ctx: PolicyContext) -> SchedulerConfig:
    return dataclasses.replace(_prefix_aware(base, ctx), num_speculative_tokens=SPECULATIVE_TOKENS)


def _mlfq_with(
    *, skip_join: bool = True, proactive_swap: bool = True, host: bool = True
) -> Configure:
    """prefix-aware under the skip-join MLFQ (ref/core/mlfq.py): :class:`MlfqSettings`'
    defaults but for the two knobs its ablations turn off.

    Service is priced by the simulator's own cost model. The host pool is as large as
    the device pool, so a displaced request's K/V always has room there; swaps are
    priced (the simulator adds each step's copies to its time) at
    ``MLFQ_KV_BYTES_PER_TOKEN`` per real token, i.e. ``scale`` times that per simulated
    token: at the default scale 16 a round trip (0.67 ms per simulated token) costs more
    than recomputing it (0.5 ms). ``preemption_mode`` stays recompute: the policy's own
    displacements go to the host whenever it has room, the spine's block-shortage
    victims recompute. The recompute ablation turns ``proactive_swap`` off (a displaced
    request is then preempted by ``preemption_mode``, recompute here) and leaves the
    host pool out (``host=False``), so nothing can reach the host.
    """

    def configure(base: SchedulerConfig, ctx: PolicyContext) -> SchedulerConfig:
        return dataclasses.replace(
            _prefix_aware(base, ctx),
            policy=PolicyName.MLFQ,
            mlfq=MlfqSettings(skip_join=skip_join, proactive_swap=proactive_swap, cost=ctx.cost),
            num_host_blocks=base.num_blocks if host else 0,
            swap_cost=mlfq_swap_cost(ctx.scale, ctx.cost),
        )

    return configure


def mlfq_swap_cost(scale: float, cost: StepCost) -> SwapCost:
    """The host link the mlfq policies swap over, per simulated token at ``scale``
    (``scale`` real tokens' K/V), recompute priced by ``cost``."""
    kv_bytes = max(1, round(MLFQ_KV_BYTES_PER_TOKEN * scale))
    return SwapCost(kv_bytes, MLFQ_LINK_GB_PER_S, iteration=cost)


POLICIES: tuple[NamedPolicy, ...] = (
    NamedPolicy(
        "static",
        "static batching: a new batch only when the whole previous one finished; whole "
        "prompts, no prefix cache",
        _static,
    ),
    NamedPolicy(
        "fcfs",
        "continuous batching, FCFS admission, whole prompts in one step (chunked prefill "
        "off), no prefix cache: a long prompt stalls every decode for its whole prefill",
        _fcfs,
    ),
    NamedPolicy(
        "chunked",
        "decode-first with chunked prefill (the derived budget B: 128 with the default "
        "cost model), no prefix cache",
        _chunked,
    ),
    NamedPolicy(
        "chunked-4B",
        "chunked with 4 x the derived budget (512 by default): a full chunk makes a step "
        "longer than the TBT SLO",
        _budget_times(4, _chunked),
    ),
    NamedPolicy(
        "prefix-aware",
        "decode-first, chunked prefill and the prefix cache on",
        _prefix_aware,
    ),
    NamedPolicy(
        "reserve",
        "prefix-aware plus example 2d's starvation fix: 1/8 of the budget reserved for a "
        "prefill that waited 8 steps",
        _reserve,
    ),
    NamedPolicy(
        "slo-aware",
        "prefix-aware plus SLO-aware chunk sizing: prefill chunks shrink so the predicted "
        "step keeps the tightest decode within the TBT SLO",
        _slo_aware,
        requires=("tbt_slo_ms", "step_cost"),
    ),
    NamedPolicy(
        "spec-0.8",
        f"prefix-aware plus speculative decoding: {SPECULATIVE_TOKENS} drafts per decode "
        "per step, each accepted with probability 0.8 (a good draft model or repetitive text)",
        _speculative,
        requires=("num_speculative_tokens",),
        speculation=SimSpeculation(0.8),
    ),
    NamedPolicy(
        "spec-0.5",
        f"prefix-aware plus speculative decoding: {SPECULATIVE_TOKENS} drafts per decode "
        "per step, each accepted with probability 0.5",
        _speculative,
        requires=("num_speculative_tokens",),
        speculation=SimSpeculation(0.5),
    ),
    NamedPolicy(
        "mlfq",
        "prefix-aware under the skip-join multi-level feedback queue: levels of growing "
        "quanta by attained service (priced by the cost model), a new request joins the "
        "level its first chunk fits, displaced requests' K/V go to a host pool as large as "
        f"the device's ({MLFQ_KV_BYTES_PER_TOKEN // 1024} KiB per real token over "
        f"{MLFQ_LINK_GB_PER_S:g} GB/s, copies priced into the step)",
        _mlfq_with(),
        requires=("mlfq", "swap_cost"),
    ),
    NamedPolicy(
        "mlfq-no-skip-join",
        "mlfq without the skip-join: every new request joins the top level (the classic "
        "MLFQ; ablation)",
        _mlfq_with(skip_join=False),
        requires=("mlfq", "swap_cost"),
    ),
    NamedPolicy(
        "mlfq-recompute",
        "mlfq without the proactive swap and without a host pool: displaced requests drop "
        "their K/V and recompute it (ablation)",
        _mlfq_with(host=False, proactive_swap=False),
        requires=("mlfq", "swap_cost"),
    ),
)
