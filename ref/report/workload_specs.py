"""The workload families ``refserve compare`` sweeps over rates (docs/ARCHITECTURE.md,
example 3): short chat, long prompt, chat with a few long prompts mixed in, agent
multi-turn sessions, and moderate prompts with heavy-tailed output lengths, the last
also on a constrained server of its own (``heavy-tight``: few seats, a small KV pool).

Token lengths are divided by the comparison's scale (see :mod:`refserve.sim.workloads`);
times (arrivals, tool waits) are not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from refserve.core.config import SchedulerConfig
from refserve.errors import InvalidArgument
from refserve.sim.workloads import (
    HEAVY_OUTPUT_ALPHA,
    HEAVY_OUTPUT_MAX,
    HEAVY_OUTPUT_MIN,
    HEAVY_PROMPT_LEN,
    Workload,
    agent_sessions,
    from_records,
    heavy_tail_records,
    long_prompt,
    long_prompt_records,
    merge_records,
    short_chat_records,
)


@dataclass(frozen=True)
class ServerLimits:
    """A trace's own engine limits, in place of the comparison's: at most
    ``max_num_seqs`` running requests and ``num_blocks`` KV blocks (every policy's; a
    policy that sizes its host pool by the device pool follows these)."""

    max_num_seqs: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"ServerLimits.{name} must be an int >= 1, got {value!r}")

    def on(self, base: SchedulerConfig) -> SchedulerConfig:
        """``base`` with these limits."""
        return dataclasses.replace(base, max_num_seqs=self.max_num_seqs, num_blocks=self.num_blocks)


@dataclass(frozen=True)
class TraceSpec:
    """A workload family swept over rates: ``build(rate, n, scale, seed)``."""

    name: str
    description: str
    rate_unit: str
    num: int
    quick_num: int
    rates: tuple[float, ...]
    quick_rates: tuple[float, ...]
    build: Callable[[float, int, float, int], Workload]
    # At least ``rate * min_window_s`` units, so arrivals last long enough for the load
    # to be sustained (an agent session lives ~10 s: 48 sessions at 16/s would all start
    # within 3 s and the system would never see 16 sessions/s in steady state).
    min_window_s: float = 0.0
    # The engine this family runs on: None, the comparison's (``--num-blocks`` and the
    # default 256 seats); else its own, whatever the command line says.
    server: ServerLimits | None = None
    # Run every policy at every rate, past its knee too (the sweep otherwise stops a
    # policy far past it): for a family whose runs are cheap and whose findings are
    # read rate by rate.
    sweep_every_rate: bool = False

    def config(self, base: SchedulerConfig) -> SchedulerConfig:
        """The comparison's base config on this family's server."""
        return base if self.server is None else self.server.on(base)

    def rates_to_sweep(self, override: tuple[float, ...] | None, quick: bool) -> tuple[float, ...]:
        """The rates a run sweeps, in the order given: ``override`` (the command line's
        ``--rates``) when set, else this family's own (quick) sweep."""
        return override or (self.quick_rates if quick else self.rates)

    def num_units(self, rate: float, num: int | None, quick: bool) -> int:
        if num is not None:
            return num
        if quick:
            return self.quick_num
        return max(self.num, math.ceil(rate * self.min_window_s))


#: Chat comes from this many applications, each with its own system prompt (real tokens):
#: a prefix shared per application, so the prefix cache has something to reuse and, at
#: scale 16, a prompt (128 + ~64 tokens) is longer than the derived token budget (128).
CHAT_APPS = 8
SYSTEM_PROMPT_LEN = 2048


def _chat_records(n: int, rate: float, scale: float, seed: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for g in range(CHAT_APPS):
        k = n // CHAT_APPS + (1 if g < n % CHAT_APPS else 0)
        if k:
            recs = short_chat_records(
                k,
                rate / CHAT_APPS,
                seed=seed * 1000 + g,
                scale=scale,
                system_prompt_len=SYSTEM_PROMPT_LEN,
            )
            out += [{**r, "tenant": f"app{g}"} for r in recs]
    return [dict(r) for r in merge_records(out)]


def _chat(rate: float, n: int, scale: float, seed: int) -> Workload:
    return Workload("chat", tuple(from_records(_chat_records(n, rate, scale, seed))))


def _long(rate: float, n: int, scale: float, seed: int) -> Workload:
    return Workload("long", tuple(long_prompt(n, rate, seed=seed, scale=scale)))


def _mixed(rate: float, n: int, scale: float, seed: int) -> Workload:
    n_long = max(1, round(n * 0.05))
    # Two tenants, so fairness asks whether the long prompts cost the chat users.
    chat = [{**r, "tenant": "chat"} for r in _chat_records(n - n_long, rate * 0.95, scale, seed)]
    long = [
        {**r, "tenant": "long"}
        for r in long_prompt_records(n_long, rate * 0.05, seed=seed + 1, scale=scale)
    ]
    return Workload("mixed", tuple(from_records(merge_records(chat, long))))


def _agent(rate: float, n: int, scale: float, seed: int) -> Workload:
    # Each session is its own tenant: fairness across sessions of one shared prefix.
    sessions = agent_sessions(n, rate, seed=seed, scale=scale)
    return Workload(
        "agent", sessions=tuple(dataclasses.replace(s, tenant=s.session_id) for s in sessions)
    )


def _heavy(rate: float, n: int, scale: float, seed: int) -> Workload:
    records = heavy_tail_records(n, rate, seed=seed, scale=scale)
    return Workload("heavy", tuple(from_records(records)))


#: ``heavy-tight``'s server. On the comparison's default one (256 seats, 4096 blocks) the
#: heavy trace's running set never fills either, so mlfq never displaces anyone and its
#: proactive swap never fires. 16 seats bind from about 24 req/s (the batch a loaded
#: rate keeps running is larger), so new requests of a higher level displace the
#: long-running ones. 132 blocks are the fewest that hold the longest request the trace
#: can draw at the default scale 16 (the 32K-token output cap plus a 768-token prompt:
#: 2,096 simulated tokens, 131 blocks), so no request finishes for lack of memory
#: whatever the seed; a loaded batch with a long output in it overflows them, so at the
#: top rates the headroom swap fires too. The host pool of the mlfq policies is as large
#: as this device pool. Each run stays under half a second.
TIGHT_SERVER = ServerLimits(max_num_seqs=16, num_blocks=132)


TRACES: tuple[TraceSpec, ...] = (
    TraceSpec(
        "chat",
        "short chat from 8 applications, each with its own 2K-token system prompt: prompt "
        "2K + ~1K (+-50 %), output ~128 (+-50 %), Poisson arrivals",
        "req/s",
        200,
        24,
        (4, 8, 12, 16, 20, 24, 28, 32),
        (4, 24),
        _chat,
    ),
    TraceSpec(
        "long",
        "long prompt: prompt ~64K (+-25 %), output ~128 (+-25 %), Poisson arrivals",
        "req/s",
        40,
        6,
        (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6),
        (0.1, 0.6),
        _long,
    ),
    TraceSpec(
        "mixed",
        "chat with 5 % long prompts mixed in (head-of-line blocking), Poisson arrivals",
        "req/s",
        200,
        24,
        (0.5, 1, 2, 3, 4, 6, 8),
        (1, 6),
        _mixed,
    ),
    TraceSpec(
        "agent",
        "agent sessions: ~80K shared prefix, 3-6 turns of +1K tokens and ~128 outputs, "
        "tool waits log-uniform 0.1-10 s; Poisson session starts",
        "sessions/s",
        48,
        4,
        (0.05, 0.1, 0.2, 0.5, 1, 2, 4, 8, 12, 16),
        (0.1, 2),
        _agent,
        min_window_s=20.0,
    ),
    TraceSpec(
        "heavy",
        f"heavy-tailed outputs: prompt ~{HEAVY_PROMPT_LEN} (+-50 %), output "
        f"{HEAVY_OUTPUT_MIN} x Pareto({HEAVY_OUTPUT_ALPHA:g}) capped at "
        f"{HEAVY_OUTPUT_MAX // 1024}K (median ~120, P99 ~4K), Poisson arrivals",
        "req/s",
        300,
        24,
        (8, 16, 24, 28, 32, 36, 40),
        (8, 32),
        _heavy,
        min_window_s=15.0,
    ),
    TraceSpec(
        "heavy-tight",
        "the heavy trace (same requests at each rate) on a constrained server: at most "
        f"{TIGHT_SERVER.max_num_seqs} running requests and {TIGHT_SERVER.num_blocks} KV "
        "blocks, where mlfq displaces running requests and swaps them out",
        "req/s",
        300,
        120,
        # 16: below the seats' limit, nothing displaces (the reference); from 24 on
        # the seats (and at the top the blocks) bind.
        (16, 24, 28, 32, 36),
        (24, 32),
        _heavy,
        min_window_s=15.0,
        server=TIGHT_SERVER,
        sweep_every_rate=True,
    ),
)
