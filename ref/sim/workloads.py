"""Workload generators: the three traces of example 3 and their arrival processes.

The experiment of docs/ARCHITECTURE.md, example 3, uses three traces of one model:

- short chat: prompt ~1K tokens, output ~128 (:func:`short_chat`);
- long prompt: prompt ~64K tokens, output ~128 (:func:`long_prompt`);
- agent multi-turn: an ~80K prefix, +1K tokens per turn, tool waits of 0.1-10 s between
  turns (:func:`agent_sessions`).

and, beyond example 3, a trace whose output lengths are heavy-tailed (Pareto: most
requests short, a few very long; :func:`heavy_tail_records`), the case a scheduler that
orders by attained service (the skip-join MLFQ) is built for.

Everything is deterministic from ``seed``. ``scale`` divides every token length (prompts,
prefixes, per-turn increments, outputs; at least 1 token each) so that tests and the
``refserve compare`` sweep run in seconds: ``scale=16`` turns the 64K prompt into 4K.
Times (arrivals, tool waits) are not scaled.

Arrivals are Poisson at ``rate_per_s`` by default. ``burstiness`` follows the convention
of vLLM's ``benchmark_serving --burstiness``: inter-arrival gaps are Gamma-distributed
with shape ``burstiness`` and mean ``1/rate``; 1 is Poisson, below 1 is burstier (the
squared coefficient of variation of the gaps is ``1/burstiness``), above 1 more regular.

Single requests are built as trace records in the :mod:`refserve.sim.trace` JSONL schema
(``prompt_len``/``output_len``, optionally ``prefix_group``/``prefix_len``) and turned into
:class:`~refserve.sim.trace.TraceRequest` by the trace parser itself, so :func:`write_trace` and
``load_trace`` round-trip exactly. Agent sessions are :class:`~refserve.sim.simulator.Session`
objects: their turns depend on when the previous turn finished, which a JSONL trace of fixed
arrival times cannot express; replay them with :func:`refserve.sim.simulator.simulate_sessions`.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from refserve.core.cost import StepCost
from refserve.core.request import Request
from refserve.core.scheduler import Scheduler
from refserve.errors import InvalidArgument
from refserve.files import atomic_write_text
from refserve.sim.simulator import (
    Session,
    SessionTurn,
    SimResult,
    SimSpeculation,
    simulate,
    simulate_closed_loop,
    simulate_sessions,
)
from refserve.sim.trace import TraceRequest, parse_trace

TraceRecord = Mapping[str, object]

# Example 3's three traces, in real (unscaled) tokens and seconds.
CHAT_PROMPT_LEN = 1024
CHAT_OUTPUT_LEN = 128
LONG_PROMPT_LEN = 65536
LONG_OUTPUT_LEN = 128
AGENT_PREFIX_LEN = 81920
AGENT_TURN_LEN = 1024
AGENT_OUTPUT_LEN = 128
AGENT_TOOL_WAIT_S = (0.1, 10.0)
# The heavy-tailed trace: moderate prompts, Pareto outputs (most short, a few very long).
HEAVY_PROMPT_LEN = 512
HEAVY_OUTPUT_MIN = 64
HEAVY_OUTPUT_ALPHA = 1.1
HEAVY_OUTPUT_MAX = 32768


def scaled(num_tokens: int, scale: float) -> int:
    """``num_tokens / scale``, rounded, at least 1."""
    # An infinite scale would silently make every length 1; NaN fails ``> 0`` already.
    if not scale > 0 or math.isinf(scale):
        raise InvalidArgument(f"scale must be a finite number > 0, got {scale!r}")
    return max(1, round(num_tokens / scale))


def arrival_times_ms(
    n: int,
    rate_per_s: float,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    start_ms: float = 0.0,
) -> list[float]:
    """``n`` arrival times (ms, non-decreasing) at a mean rate of ``rate_per_s``.

    Gaps are Gamma(shape=burstiness, mean=1/rate): Poisson for ``burstiness=1``. The first
    request arrives at ``start_ms``. An infinite rate puts every arrival at ``start_ms``.
    """
    if n < 0:
        raise InvalidArgument(f"n must be >= 0, got {n}")
    if not rate_per_s > 0:
        raise InvalidArgument(f"rate_per_s must be > 0, got {rate_per_s!r}")
    if not burstiness > 0 or math.isinf(burstiness):
        raise InvalidArgument(f"burstiness must be a finite number > 0, got {burstiness!r}")
    if math.isinf(rate_per_s):
        return [start_ms] * n
    rng = random.Random(f"arrivals:{seed}")
    mean_gap_ms = 1e3 / rate_per_s
    out: list[float] = []
    t = start_ms
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, mean_gap_ms / burstiness)
        out.append(round(t, 6))
    return out


def _around(rng: random.Random, mean: int, spread: float) -> int:
    """A length uniform in ``mean * [1 - spread, 1 + spread]``, at least 1."""
    lo = max(1, round(mean * (1 - spread)))
    hi = max(lo, round(mean * (1 + spread)))
    return rng.randint(lo, hi)


def _records(
    name: str,
    n: int,
    rate_per_s: float,
    prompt_len: int,
    output_len: int,
    *,
    seed: int,
    scale: float,
    burstiness: float,
    spread: float,
    prefix_len: int = 0,
) -> list[dict[str, object]]:
    if not 0 <= spread < 1:
        raise InvalidArgument(f"spread must be in [0, 1), got {spread!r}")
    rng = random.Random(f"{name}:{seed}")
    times = arrival_times_ms(n, rate_per_s, seed=seed, burstiness=burstiness)
    prompt, output = scaled(prompt_len, scale), scaled(output_len, scale)
    prefix = scaled(prefix_len, scale) if prefix_len else 0
    out: list[dict[str, object]] = []
    for i, t in enumerate(times):
        rec: dict[str, object] = {
            "id": f"{name}-{seed}-{i}",
            "arrival_ms": t,
            "prompt_len": prefix + _around(rng, prompt, spread),
            "output_len": _around(rng, output, spread),
        }
        if prefix:
            rec["prefix_group"] = f"{name}-{seed}-system"
            rec["prefix_len"] = prefix
        out.append(rec)
    return out


def short_chat_records(
    n: int,
    rate_per_s: float,
    *,
    seed: int = 0,
    scale: float = 1.0,
    burstiness: float = 1.0,
    spread: float = 0.5,
    system_prompt_len: int = 0,
) -> list[dict[str, object]]:
    """Example 3's short chat as trace records: prompt ~1K, output ~128 (each +-``spread``).

    ``system_prompt_len`` (real tokens) puts a prefix shared by every request in front.
    """
    return _records(
        "chat",
        n,
        rate_per_s,
        CHAT_PROMPT_LEN,
        CHAT_OUTPUT_LEN,
        seed=seed,
        scale=scale,
        burstiness=burstiness,
        spread=spread,
        prefix_len=system_prompt_len,
    )


def long_prompt_records(
    n: int,
    rate_per_s: float,
    *,
    seed: int = 0,
    scale: float = 1.0,
    burstiness: float = 1.0,
    spread: float = 0.25,
) -> list[dict[str, object]]:
    """Example 3's long-prompt trace as records: prompt ~64K, output ~128."""
    return _records(
        "long",
        n,
        rate_per_s,
        LONG_PROMPT_LEN,
        LONG_OUTPUT_LEN,
        seed=seed,
        scale=scale,
        burstiness=burstiness,
        spread=spread,
    )


def short_chat(
    n: int,
    rate_per_s: float,
    *,
    seed: int = 0,
    scale: float = 1.0,
    burstiness: float = 1.0,
    spread: float = 0.5,
    system_prompt_len: int = 0,
) -> list[TraceRequest]:
    """:func:`short_chat_records` parsed into trace requests."""
    return from_records(
        short_chat_records(
            n,
            rate_per_s,
            seed=seed,
            scale=scale,
            burstiness=burstiness,
            spread=spread,
            system_prompt_len=system_prompt_len,
        )
    )


def long_prompt(
    n: int,
    rate_per_s: float,
    *,
    seed: int = 0,
    scale: float = 1.0,
    burstiness: float = 1.0,
    spread: float = 0.25,
) -> list[TraceRequest]:
    """:func:`long_prompt_records` parsed into trace requests."""
    return from_records(
        long_prompt_records(
            n, rate_per_s, seed=seed, scale=scale, burstiness=burstiness, spread=spread
        )
    )


def heavy_tail_records(
    n: int,
    rate_per_s: float,
    *,
    seed: int = 0,
    scale: float = 1.0,
    burstiness: float = 1.0,
    prompt_len: int = HEAVY_PROMPT_LEN,
    spread: float = 0.5,
    output_min: int = HEAVY_OUTPUT_MIN,
    alpha: float = HEAVY_OUTPUT_ALPHA,
    output_max: int = HEAVY_OUTPUT_MAX,
) -> list[dict[str, object]]:
    """Heavy-tailed output lengths as trace records: prompt ~``prompt_len`` (+-``spread``),
    output ``output_min`` times a Pareto(``alpha``) draw, capped at ``output_max`` (real
    tokens, then divided by ``scale``).

    With the defaults (64, alpha 1.1, cap 32K) the median output is ~120 tokens, the
    95th percentile ~970, the 99th ~4K and the longest of a few thousand requests near
    the cap: most requests are short and a few hold the server for a long time, the case a
    scheduler that knows nothing of output lengths can get badly wrong (a long request
    in front of short ones, or every request sharing the steps equally).
    """
    if not 0 <= spread < 1:
        raise InvalidArgument(f"spread must be in [0, 1), got {spread!r}")
    if not (alpha > 0 and math.isfinite(alpha)):
        raise InvalidArgument(f"alpha must be a finite number > 0, got {alpha!r}")
    if not 1 <= output_min <= output_max:
        raise InvalidArgument(
            f"output lengths need 1 <= output_min <= output_max, got {output_min}, {output_max}"
        )
    if prompt_len < 1:
        raise InvalidArgument(f"prompt_len must be >= 1, got {prompt_len}")
    rng = random.Random(f"heavy:{seed}")
    times = arrival_times_ms(n, rate_per_s, seed=seed, burstiness=burstiness)
    prompt = scaled(prompt_len, scale)
    out: list[dict[str, object]] = []
    for i, t in enumerate(times):
        p = _around(rng, prompt, spread)
        real = min(output_max, round(output_min * rng.paretovariate(alpha)))
        out.append(
            {
                "id": f"heavy-{seed}-{i}",
                "arrival_ms": t,
                "prompt_len": p,
                "output_len": scaled(real, scale),
            }
        )
    return out


def merge_records(*traces: Sequence[TraceRecord]) -> list[TraceRecord]:
    """Interleave several traces by arrival time (stable), e.g. chat with a few long prompts."""
    merged = [r for t in traces for r in t]
    ids = [r["id"] for r in merged]
    if len(set(ids)) != len(ids):
        raise InvalidArgument("merge_records: the traces share request ids")
    return sorted(merged, key=_arrival)


def _arrival(record: TraceRecord) -> float:
    t = record.get("arrival_ms", 0.0)
    return float(t) if isinstance(t, int | float) else 0.0


def agent_sessions(
    n: int,
    rate_per_s: float,
    *,
    seed: int = 0,
    scale: float = 1.0,
    burstiness: float = 1.0,
    turns: tuple[int, int] = (3, 6),
    prefix_len: int = AGENT_PREFIX_LEN,
    turn_len: int = AGENT_TURN_LEN,
    output_len: int = AGENT_OUTPUT_LEN,
    tool_wait_s: tuple[float, float] = AGENT_TOOL_WAIT_S,
    num_prefixes: int = 1,
) -> list[Session]:
    """Example 3's agent trace: ``n`` sessions starting at ``rate_per_s`` (Poisson/bursty).

    Each session opens with one of ``num_prefixes`` shared ~80K-token prefixes (the agent's
    system prompt, tools and context: shared by the sessions of one agent) plus ~1K
    session tokens; every later turn appends ~1K new tokens (tool output and the next
    instruction) to the previous turn's prompt and outputs, after a tool wait drawn
    log-uniformly from ``tool_wait_s`` (0.1-10 s: median 1 s). Outputs are ~128 tokens.
    The number of turns is uniform in ``turns`` (inclusive). Lengths vary by +-25 %.
    """
    lo_turns, hi_turns = turns
    if not 1 <= lo_turns <= hi_turns:
        raise InvalidArgument(f"turns must be (lo, hi) with 1 <= lo <= hi, got {turns!r}")
    lo_wait, hi_wait = tool_wait_s
    # Finite: an infinite wait releases the next turn at t=inf and the makespan with it.
    if not 0 < lo_wait <= hi_wait or math.isinf(hi_wait):
        raise InvalidArgument(f"tool_wait_s must be (lo, hi) with 0 < lo <= hi, got {tool_wait_s}")
    if num_prefixes < 1:
        raise InvalidArgument(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = random.Random(f"agent:{seed}")
    starts = arrival_times_ms(n, rate_per_s, seed=seed, burstiness=burstiness)
    plen = scaled(prefix_len, scale)
    prefixes = [_tokens(f"agent-prefix:{seed}:{g}", plen) for g in range(num_prefixes)]
    tlen, olen = scaled(turn_len, scale), scaled(output_len, scale)
    out: list[Session] = []
    for i, start in enumerate(starts):
        sid = f"agent-{seed}-{i}"
        k_turns = rng.randint(lo_turns, hi_turns)
        session_turns: list[SessionTurn] = []
        for k in range(k_turns):
            new = _tokens(f"{sid}:{k}", _around(rng, tlen, 0.25))
            if k == 0:
                new = (*prefixes[i % num_prefixes], *new)
            wait_s = math.exp(rng.uniform(math.log(lo_wait), math.log(hi_wait))) if k else 0.0
            session_turns.append(SessionTurn(new, _around(rng, olen, 0.25), round(wait_s * 1e3, 3)))
        out.append(Session(sid, start, tuple(session_turns)))
    return out


def _tokens(key: str, n: int) -> tuple[int, ...]:
    rng = random.Random(key)
    return tuple(rng.randrange(256, 32000) for _ in range(n))


def session_max_len(session: Session) -> int:
    """Tokens in the session's last turn when every turn emits all its outputs."""
    return sum(len(t.new_token_ids) + t.output_len for t in session.turns)


def trace_max_len(trace: Sequence[TraceRequest]) -> int:
    """The longest prompt + output in a trace (0 for none)."""
    return max((len(t.prompt_token_ids) + t.output_len for t in trace), default=0)


# ------------------------------------------------------------------ JSONL, requests
def records_to_jsonl(records: Sequence[TraceRecord]) -> str:
    """Standard JSON lines: a NaN or infinite value is refused, not written as ``NaN``."""
    lines = []
    for i, r in enumerate(records):
        try:
            lines.append(json.dumps(dict(r), allow_nan=False) + "\n")
        except ValueError:
            raise InvalidArgument(
                f"trace record {i} ({r.get('id')!r}): a number is NaN or infinite"
            ) from None
    return "".join(lines)


def from_records(records: Sequence[TraceRecord], name: str = "<generated>") -> list[TraceRequest]:
    """Records -> trace requests through the trace parser (checks them like a file)."""
    return parse_trace(records_to_jsonl(records), name)


def write_trace(path: Path, trace: Sequence[TraceRecord] | Sequence[TraceRequest]) -> Path:
    """Write a JSONL trace ``load_trace`` reads back to the same requests.

    Records are written as they are (compact: ``prompt_len`` and ``prefix_group``); trace
    requests with their exact ``prompt_token_ids``.
    """
    lines: list[TraceRecord] = []
    for item in trace:
        if isinstance(item, TraceRequest):
            rec: dict[str, object] = {
                "id": item.id,
                "arrival_ms": item.arrival_ms,
                "prompt_token_ids": list(item.prompt_token_ids),
                "output_len": item.output_len,
            }
            if item.priority:
                rec["priority"] = item.priority
            if item.tenant != "default":
                rec["tenant"] = item.tenant
            lines.append(rec)
        else:
            lines.append(item)
    from_records(lines, str(path))  # validate before writing anything
    return atomic_write_text(path, records_to_jsonl(lines), "trace")


def to_requests(trace: Sequence[TraceRequest]) -> list[Request]:
    """Fresh engine requests (a request object runs once; build new ones per run)."""
    return [t.to_request() for t in trace]


# ------------------------------------------------------------------ a runnable workload
@dataclass(frozen=True)
class Workload:
    """Open-loop single requests and/or agent sessions, replayed on the simulator together.

    A workload holds specs, never engine requests, so it can be run any number of times
    (each run builds fresh :class:`~refserve.core.request.Request` objects).
    """

    name: str
    requests: tuple[TraceRequest, ...] = ()
    sessions: tuple[Session, ...] = ()

    @property
    def num_requests(self) -> int:
        """Requests the workload offers (a session counts each of its turns)."""
        return len(self.requests) + sum(len(s.turns) for s in self.sessions)

    @property
    def max_len(self) -> int:
        """The longest sequence (prompt + outputs) any of its requests can reach."""
        return max(
            trace_max_len(self.requests),
            max((session_max_len(s) for s in self.sessions), default=0),
        )

    def run(
        self,
        scheduler: Scheduler,
        cost: StepCost,
        *,
        concurrency: int | None = None,
        check_invariants: bool = False,
        keep_steps: bool = True,
        speculation: SimSpeculation | None = None,
    ) -> SimResult:
        """Replay on the simulator: by arrival time, or closed loop with ``concurrency``;
        with speculative decoding under ``speculation``.

        Sessions' turns are always released ``tool_wait_ms`` after the previous turn. In
        closed loop a session holds one slot from its first turn to its last; single
        requests come before sessions in release order.
        """
        singles = to_requests(self.requests)
        if not self.sessions and concurrency is None:
            return simulate(
                scheduler,
                singles,
                cost,
                check_invariants=check_invariants,
                keep_steps=keep_steps,
                speculation=speculation,
            )
        if not self.sessions:
            assert concurrency is not None
            return simulate_closed_loop(
                scheduler,
                singles,
                cost,
                concurrency=concurrency,
                check_invariants=check_invariants,
                keep_steps=keep_steps,
                speculation=speculation,
            )
        # A single request is a one-turn session; its prompt is its own new tokens.
        as_sessions = [
            Session(
                t.id,
                t.arrival_ms,
                (SessionTurn(t.prompt_token_ids, t.output_len),),
                t.priority,
                t.tenant,
                turn_ids=False,
            )
            for t in self.requests
        ]
        return simulate_sessions(
            scheduler,
            [*as_sessions, *self.sessions],
            cost,
            concurrency=concurrency,
            check_invariants=check_invariants,
            keep_steps=keep_steps,
            speculation=speculation,
        )
