"""``refserve bench-serve``: an open-loop load generator for any OpenAI-compatible server.

Requests are sent at their arrival times whatever the server is doing (open loop: a slow
server does not slow the arrivals down, it builds a queue, as real traffic would), each
a streaming ``/v1/completions`` with ``stream_options.include_usage`` so the token counts
are the server's own (``usage``), not a guess from the text. Per request it records
its timeline: arrival, first token, the time of every streamed chunk, finish, tokens in
and out (from ``usage``), status. The summary: P50/P95/P99 TTFT, P99 TBT (the gaps
between streamed chunks; a chunk may carry more than one token), input and output
tokens/s apart, goodput under stated SLOs, and the errors.

Traces: ``chat`` / ``long`` (example 3's short chat and long prompt, lengths divided by
``scale``), ``mixed`` (chat with one long prompt in ten), ``agent`` (multi-turn sessions:
each turn sends the conversation so far plus a tool answer, after a tool wait; the next
turn starts when the previous one finished, so sessions are closed loop inside, open loop
between), or a JSONL trace file (ref/sim/trace.py; ``prompt_len`` and ``output_len``).
Prompts are text: deterministic random lowercase words of ``prompt_len`` characters
(exactly that many tokens on a byte tokenizer, fewer on a BPE one: ``usage`` says).

Goodput: requests per second that finished ``ok`` with TTFT <= ``slo_ttft_ms`` and a mean
time per output token (TPOT, vLLM's definition) <= ``slo_tpot_ms``. ``--sweep`` runs the
same trace at each rate; the knee is the highest rate whose goodput is still at least 90%
of the rate offered.

A broken server never hangs the tool or ends it with a traceback: every request has a
timeout, and whatever it answers (an error status, a malformed event, a dropped
connection) is recorded as that request's status.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from refserve.errors import InvalidArgument
from refserve.sim.metrics import percentile
from refserve.sim.trace import load_trace
from refserve.sim.workloads import (
    AGENT_OUTPUT_LEN,
    AGENT_TURN_LEN,
    arrival_times_ms,
    long_prompt_records,
    merge_records,
    scaled,
    short_chat_records,
)
from refserve.values import is_number

TRACES = ("chat", "long", "mixed", "agent")
#: The knee: the highest rate whose goodput is at least this fraction of the offered rate.
KNEE_FRACTION = 0.9
#: The most requests one run may send (each is a task and a record in memory).
MAX_REQUESTS = 100_000


@dataclass(frozen=True)
class Planned:
    """One request to send: when, what, how much output."""

    id: str
    arrival_s: float
    prompt: str
    max_tokens: int
    session: str | None = None
    turn: int = 0
    tool_wait_s: float = 0.0


@dataclass
class Record:
    """What happened to one request (times in seconds from the start of the run)."""

    id: str
    arrival_s: float
    sent_s: float | None = None
    first_token_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    status: str = "not sent"
    output_text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_s is None or self.sent_s is None:
            return None
        return (self.first_token_s - self.sent_s) * 1e3

    @property
    def tbt_ms(self) -> list[float]:
        t = self.chunk_times_s
        return [(b - a) * 1e3 for a, b in itertools.pairwise(t)]

    @property
    def tpot_ms(self) -> float | None:
        n = self.completion_tokens
        if n is None or n < 2 or self.first_token_s is None or self.finish_s is None:
            return None
        return (self.finish_s - self.first_token_s) * 1e3 / (n - 1)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0


@dataclass(frozen=True)
class Summary:
    rate: float
    num_requests: int
    num_ok: int
    num_errors: int
    errors: dict[str, int]
    duration_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    tbt_p99_ms: float | None
    tpot_mean_ms: float | None
    input_tokens_per_s: float
    output_tokens_per_s: float
    requests_per_s: float
    goodput_per_s: float
    slo_ttft_ms: float
    slo_tpot_ms: float


# --------------------------------------------------------------------- planning
def _text(rng: random.Random, n: int) -> str:
    """``n`` characters of lowercase words (a byte tokenizer makes them ``n`` tokens)."""
    out: list[str] = []
    size = 0
    while size < n:
        word = "".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(2, 7)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n]


def plan(
    trace: str,
    *,
    rate: float,
    num_requests: int | None,
    duration_s: float | None,
    scale: float,
    seed: int,
) -> list[Planned]:
    """The requests of one run, in arrival order."""
    n = num_requests if num_requests is not None else _count_for(rate, duration_s)
    if not 1 <= n <= MAX_REQUESTS:
        raise InvalidArgument(f"the run would send {n} requests; 1 to {MAX_REQUESTS} allowed")
    rng = random.Random(f"bench-serve:{seed}")
    if trace == "agent":
        return _agent(n, rate, scale, seed, rng)
    records: list[Any]
    if trace in ("chat", "long", "mixed"):
        records = _records(trace, n, rate, scale, seed)
    else:
        records = [
            {"id": t.id, "arrival_ms": t.arrival_ms, "prompt_len": len(t.prompt_token_ids),
             "output_len": t.output_len}
            for t in load_trace(trace)
        ][:n]  # fmt: skip
    out = [
        Planned(
            str(r["id"]),
            _number(r["arrival_ms"]) / 1e3,
            _text(rng, int(_number(r["prompt_len"]))),
            int(_number(r["output_len"])),
        )
        for r in records
    ]
    if duration_s is not None:
        out = [p for p in out if p.arrival_s <= duration_s] or out[:1]
    return out


def _number(value: object) -> float:
    # Trace records come from refserve.sim (already validated): numbers, never bools.
    if not is_number(value):
        raise InvalidArgument(f"trace record: expected a number, got {value!r}")
    return float(value)


def _count_for(rate: float, duration_s: float | None) -> int:
    if duration_s is None:
        raise InvalidArgument("give --num-requests or --duration")
    if math.isinf(rate):
        raise InvalidArgument("--duration needs a finite --rate")
    # Enough arrivals to cover the duration (Poisson: mean + a margin), cut afterwards.
    mean = rate * duration_s
    return min(MAX_REQUESTS, max(1, int(mean + 5 * math.sqrt(mean) + 10)))


def _records(trace: str, n: int, rate: float, scale: float, seed: int) -> list[Any]:
    if trace == "chat":
        return short_chat_records(n, rate, seed=seed, scale=scale)
    if trace == "long":
        return long_prompt_records(n, rate, seed=seed, scale=scale)
    n_long = max(1, n // 10)
    chat = short_chat_records(n - n_long, rate * (n - n_long) / n, seed=seed, scale=scale)
    long = long_prompt_records(n_long, rate * n_long / n, seed=seed + 1, scale=scale)
    return list(merge_records(chat, long))


def _agent(n: int, rate: float, scale: float, seed: int, rng: random.Random) -> list[Planned]:
    """``n`` requests as sessions of 3 turns; sessions start at ``rate``."""
    turns = 3
    sessions = max(1, n // turns)
    starts = arrival_times_ms(sessions, rate, seed=seed)
    turn_len, out_len = scaled(AGENT_TURN_LEN, scale), scaled(AGENT_OUTPUT_LEN, scale)
    planned: list[Planned] = []
    for s, start in enumerate(starts):
        for t in range(turns):
            planned.append(
                Planned(
                    f"agent-{seed}-{s}-{t}",
                    start / 1e3,
                    _text(rng, turn_len),
                    out_len,
                    session=f"agent-{seed}-{s}",
                    turn=t,
                    tool_wait_s=0.0 if t == 0 else rng.uniform(0.05, 0.5),
                )
            )
    return planned


# --------------------------------------------------------------------- running
@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 300.0
    ignore_eos: bool = True


async def _send(
    client: httpx.AsyncClient, target: Target, p: Planned, prompt: str, rec: Record, t0: float
) -> None:
    body: dict[str, Any] = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": p.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    rec.sent_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(target.timeout_s):
            headers = {"X-Request-Id": rec.id}  # the server may report it by this name
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    rec.status = f"http {r.status_code}"
                    return
                await _read_stream(r, rec, t0)
    except TimeoutError:
        rec.status = f"timeout after {target.timeout_s:g} s"
    except httpx.HTTPError as e:
        rec.status = f"{type(e).__name__}"
    except (ValueError, KeyError, TypeError) as e:  # a malformed event
        rec.status = f"bad stream: {type(e).__name__}"
    rec.finish_s = time.perf_counter() - t0


async def _read_stream(r: httpx.Response, rec: Record, t0: float) -> None:
    done = False
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        now = time.perf_counter() - t0
        for ch in event.get("choices") or []:
            text = ch.get("text") or ""
            if text:
                rec.chunk_times_s.append(now)
                rec.output_text += text
                if rec.first_token_s is None:
                    rec.first_token_s = now
            if ch.get("finish_reason"):
                rec.finish_reason = ch["finish_reason"]
        usage = event.get("usage")
        if isinstance(usage, dict):
            rec.prompt_tokens = int(usage["prompt_tokens"])
            rec.completion_tokens = int(usage["completion_tokens"])
    rec.status = "ok" if done else "stream ended without [DONE]"
    if rec.ok and rec.completion_tokens is None:
        rec.status = "no usage in the stream"


async def _run_single(
    client: httpx.AsyncClient,
    target: Target,
    p: Planned,
    rec: Record,
    t0: float,
    tick: Callable[[], object],
) -> None:
    await asyncio.sleep(max(0.0, p.arrival_s - (time.perf_counter() - t0)))
    await _send(client, target, p, p.prompt, rec, t0)
    tick()


async def _run_session(
    client: httpx.AsyncClient,
    target: Target,
    turns: Sequence[Planned],
    recs: Sequence[Record],
    t0: float,
    tick: Callable[[], object],
) -> None:
    await asyncio.sleep(max(0.0, turns[0].arrival_s - (time.perf_counter() - t0)))
    conversation = ""
    for p, rec in zip(turns, recs, strict=True):
        await asyncio.sleep(p.tool_wait_s)
        rec.arrival_s = time.perf_counter() - t0
        conversation += p.prompt
        await _send(client, target, p, conversation, rec, t0)
        tick()
        if not rec.ok:
            for later in recs[recs.index(rec) + 1 :]:
                later.status = "session ended early"
                tick()
            return
        conversation += rec.output_text


async def run_load(
    target: Target, planned: Sequence[Planned], progress: Callable[[], object] | None = None
) -> tuple[list[Record], float]:
    """Send every planned request at its time; the records and the run's duration (s)."""
    recs = [Record(p.id, p.arrival_s) for p in planned]
    tick: Callable[[], object] = progress or (lambda: None)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=target.base_url.rstrip("/"), headers=headers, limits=limits, timeout=None
    ) as client:
        t0 = time.perf_counter()
        tasks = []
        sessions: dict[str, list[int]] = {}
        for i, p in enumerate(planned):
            if p.session is None:
                tasks.append(_run_single(client, target, p, recs[i], t0, tick))
            else:
                sessions.setdefault(p.session, []).append(i)
        for idx in sessions.values():
            tasks.append(
                _run_session(
                    client, target, [planned[i] for i in idx], [recs[i] for i in idx], t0, tick
                )
            )
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return recs, duration


# --------------------------------------------------------------------- summary
def _errors(recs: Sequence[Record]) -> dict[str, int]:
    errors: dict[str, int] = {}
    for r in recs:
        if not r.ok:
            errors[r.status] = errors.get(r.status, 0) + 1
    return errors


def _good(r: Record, slo: Slo) -> bool:
    """Within the SLOs: TTFT, and TPOT when the request has two tokens or more."""
    ttft, tpot = r.ttft_ms, r.tpot_ms
    return ttft is not None and ttft <= slo.ttft_ms and (tpot is None or tpot <= slo.tpot_ms)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(rate: float, recs: Sequence[Record], duration_s: float, slo: Slo) -> Summary:
    ok = [r for r in recs if r.ok]
    ttfts = [t for r in ok if (t := r.ttft_ms) is not None]
    tbts = [g for r in ok for g in r.tbt_ms]
    secs = max(duration_s, 1e-9)
    return Summary(
        rate=rate,
        num_requests=len(recs),
        num_ok=len(ok),
        num_errors=len(recs) - len(ok),
        errors=_errors(recs),
        duration_s=duration_s,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p95_ms=percentile(ttfts, 95),
        ttft_p99_ms=percentile(ttfts, 99),
        tbt_p99_ms=percentile(tbts, 99),
        tpot_mean_ms=_mean([t for r in ok if (t := r.tpot_ms) is not None]),
        input_tokens_per_s=sum(r.prompt_tokens or 0 for r in ok) / secs,
        output_tokens_per_s=sum(r.completion_tokens or 0 for r in ok) / secs,
        requests_per_s=len(ok) / secs,
        goodput_per_s=sum(_good(r, slo) for r in ok) / secs,
        slo_ttft_ms=slo.ttft_ms,
        slo_tpot_ms=slo.tpot_ms,
    )


def knee(summaries: Sequence[Summary]) -> float | None:
    """The highest rate whose goodput is at least :data:`KNEE_FRACTION` of it."""
    kept = [s.rate for s in summaries if s.goodput_per_s >= KNEE_FRACTION * s.rate]
    return max(kept) if kept else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(summaries: Sequence[Summary]) -> str:
    head = (
        "| rate (req/s) | requests | ok | errors | TTFT P50 ms | TTFT P95 ms | TTFT P99 ms "
        "| TBT P99 ms | in tok/s | out tok/s | goodput req/s |"
    )
    lines = [head, "|" + "---:|" * 11]
    for s in summaries:
        lines.append(
            f"| {s.rate:g} | {s.num_requests} | {s.num_ok} | {s.num_errors} "
            f"| {_ms(s.ttft_p50_ms)} | {_ms(s.ttft_p95_ms)} | {_ms(s.ttft_p99_ms)} "
            f"| {_ms(s.tbt_p99_ms)} | {s.input_tokens_per_s:.0f} | {s.output_tokens_per_s:.0f} "
            f"| {s.goodput_per_s:.2f} |"
        )
    return "\n".join(lines)


def report_doc(
    target: Target, trace: str, runs: Sequence[tuple[Summary, Sequence[Record]]]
) -> dict[str, Any]:
    summaries = [s for s, _ in runs]
    return {
        "format": "refserve-bench-serve",
        "version": 1,
        "base_url": target.base_url,
        "model": target.model,
        "trace": trace,
        "knee_rate": knee(summaries),
        "runs": [
            {
                "summary": asdict(s),
                "requests": [
                    {
                        "id": r.id,
                        "arrival_s": r.arrival_s,
                        "sent_s": r.sent_s,
                        "first_token_s": r.first_token_s,
                        "token_times_s": r.chunk_times_s,
                        "finish_s": r.finish_s,
                        "tokens_in": r.prompt_tokens,
                        "tokens_out": r.completion_tokens,
                        "finish_reason": r.finish_reason,
                        "status": r.status,
                    }
                    for r in recs
                ],
            }
            for s, recs in runs
        ],
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    from refserve.files import atomic_write_text

    atomic_write_text(path, json.dumps(doc, indent=2, allow_nan=False) + "\n", "--json")
