"""``make soak``: the served cluster under open-loop load for a fixed time, with faults at
drawn moments, held to four promises (docs/CLUSTER.md, "Soak").

The load: requests arrive at exponential gaps (``rate_rps``; open loop, as
``bench-serve``: a slow server builds a queue, it does not slow the arrivals), each of a
kind drawn from a seeded generator: a streamed completion read to its end, a plain one,
a stream the client drops after a drawn number of events (a disconnect mid-stream), a
plain request the client gives up on after a drawn delay (an abort: the server notices
and aborts it), and a bad request (a broken body, a parameter out of range, an unknown
model). Replica kills come at their own drawn moments (``POST /debug/replicas/{i}/kill``,
the server's ``--fault-endpoints``); the cluster restarts a dead replica
(``--max-replica-restarts``). The whole plan is drawn before the run from ``seed``.

The promises, each a failure of the soak when broken:

- **ends**: every request ended exactly once, with a result (a finish reason on every
  choice, then ``[DONE]`` for a stream) or a typed error (OpenAI's error body, as an
  answer or as the stream's last event), or the client's own leaving. A second finish
  reason, an event after the end, a stream that stops without either, an untyped answer
  or a timeout is a failure, named with its request.
- **pools**: once the load has stopped and every request settled, each live replica's
  pools pass the spec's pool checks and the LEAK rule (``/debug/pools``:
  ref/cluster/pool_check.py), hold no request and no block table, and every block is
  free again.
- **memory**: the server's resident memory (each replica's process, as ``/debug/pools``
  reports it; in-process replicas share one) grows by at most ``rss_bound_mib`` from the
  end of the warm-up (``warmup_fraction`` of the run) to the end.
- **error budget**: the requests the client kept (not dropped, not bad on purpose) that
  ended with an error are at most ``error_budget`` of them; a kill ends a replica's
  requests that delivered output with a 503, so kills spend this budget.

Figures: throughput (requests ended and tokens received per second), goodput (requests
per second that ended with a result within ``slo_e2e_s``), the error budget used, the
kills and restarts seen (``/metrics``), the RSS samples; all in one JSON
(``refserve-soak``) that ``refserve.conformance.bench.report`` renders into
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx

from refserve.conformance.bench.machine import Provenance
from refserve.errors import InvalidArgument
from refserve.values import is_number

FORMAT = "refserve-soak"
MODEL = "tiny-trained"
#: The server's line that names its address (ref/cli/serve.py).
_SERVING = re.compile(r"on (http://[^\s/]+)/v1")


class Kind(StrEnum):
    """What a planned request does (module doc)."""

    STREAM = "stream"
    PLAIN = "plain"
    DISCONNECT = "disconnect"
    ABORT = "abort"
    BAD = "bad"


#: The drawn share of each kind.
MIX: dict[Kind, float] = {
    Kind.STREAM: 0.45,
    Kind.PLAIN: 0.2,
    Kind.DISCONNECT: 0.12,
    Kind.ABORT: 0.11,
    Kind.BAD: 0.12,
}

#: The bad requests drawn from: (what is wrong, the body, the status a typed refusal has).
BAD_BODIES: tuple[tuple[str, dict[str, Any] | str, int], ...] = (
    ("negative temperature", {"prompt": "Hi", "max_tokens": 4, "temperature": -1.0}, 400),
    ("zero max_tokens", {"prompt": "Hi", "max_tokens": 0}, 400),
    ("no prompt", {"max_tokens": 4}, 400),
    ("unknown model", {"model": "no-such-model", "prompt": "Hi", "max_tokens": 4}, 404),
    ("not JSON", "{not json", 400),
)


@dataclass(frozen=True)
class SoakSettings:
    """What a soak runs and what it holds the server to (module doc)."""

    duration_s: float = 600.0
    rate_rps: float = 3.0
    seed: int = 0
    kill_every_s: float = 45.0
    """Mean gap between two replica kills (exponential); 0: no kill."""
    replicas: int = 2
    max_tokens: tuple[int, int] = (16, 160)
    prompt_chars: tuple[int, int] = (8, 200)
    request_timeout_s: float = 120.0
    settle_s: float = 60.0
    """After the last arrival: how long the requests in flight get to end."""
    rss_bound_mib: float = 64.0
    warmup_fraction: float = 0.25
    error_budget: float = 0.05
    slo_e2e_s: float = 10.0
    rss_every_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("duration_s", "rate_rps", "request_timeout_s", "rss_every_s"):
            v = getattr(self, name)
            if not is_number(v) or not v > 0:
                raise InvalidArgument(f"soak: {name} must be > 0, got {v!r}")
        if self.kill_every_s < 0 or self.settle_s < 0 or self.rss_bound_mib < 0:
            raise InvalidArgument("soak: kill_every_s, settle_s and rss_bound_mib are >= 0")
        if not 0 <= self.warmup_fraction < 1 or not 0 <= self.error_budget <= 1:
            raise InvalidArgument("soak: warmup_fraction in [0, 1), error_budget in [0, 1]")
        if self.replicas < 1:
            raise InvalidArgument(f"soak: replicas must be >= 1, got {self.replicas}")


@dataclass(frozen=True)
class Planned:
    """One request of the plan: when, what, and the kind's drawn parameter."""

    index: int
    at_s: float
    kind: Kind
    prompt: str
    max_tokens: int
    leave_after_events: int = 0
    """DISCONNECT: the events read before the client drops the stream."""
    abort_after_s: float = 0.0
    """ABORT: how long the client waits before it gives up."""
    bad: int = 0
    """BAD: which of :data:`BAD_BODIES`."""


@dataclass(frozen=True)
class Kill:
    at_s: float
    replica: int


@dataclass(frozen=True)
class Plan:
    requests: tuple[Planned, ...]
    kills: tuple[Kill, ...]


def _text(rng: random.Random, n: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n:
        words.append(
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
        )
    return " ".join(words)[:n]


def plan(s: SoakSettings) -> Plan:
    """The whole run, drawn from ``s.seed`` (module doc)."""
    rng = random.Random(s.seed)
    kinds, weights = list(MIX), list(MIX.values())
    out: list[Planned] = []
    t = rng.expovariate(s.rate_rps)
    while t < s.duration_s:
        kind = rng.choices(kinds, weights)[0]
        out.append(
            Planned(
                index=len(out),
                at_s=t,
                kind=kind,
                prompt=_text(rng, rng.randint(*s.prompt_chars)),
                max_tokens=rng.randint(*s.max_tokens),
                leave_after_events=rng.randint(1, 6),
                abort_after_s=rng.uniform(0.05, 1.5),
                bad=rng.randrange(len(BAD_BODIES)),
            )
        )
        t += rng.expovariate(s.rate_rps)
    kills: list[Kill] = []
    if s.kill_every_s > 0:
        t = rng.expovariate(1.0 / s.kill_every_s)
        while t < s.duration_s:
            kills.append(Kill(t, rng.randrange(s.replicas)))
            t += rng.expovariate(1.0 / s.kill_every_s)
    return Plan(tuple(out), tuple(kills))


# --------------------------------------------------------------------- how requests end
class End(StrEnum):
    OK = "ok"
    """A result: a finish reason on every choice (and ``[DONE]`` for a stream)."""
    ERROR = "error"
    """A typed error: OpenAI's error body, as the answer or as the stream's last event."""
    LEFT = "left"
    """The client left on purpose (a disconnect or an abort) before the end."""
    REFUSED = "refused"
    """A bad request refused with the typed error its fault calls for."""
    BROKEN = "broken"
    """None of the above: an untyped answer, a second end, a stream cut, a timeout."""


@dataclass
class Outcome:
    """How one planned request ended (exactly one :class:`End`), with its figures."""

    index: int
    kind: Kind
    end: End | None = None
    detail: str = ""
    status: int | None = None
    error_type: str | None = None
    tokens: int = 0
    sent_s: float = 0.0
    e2e_s: float | None = None
    ends: int = 0
    """How many times an end was recorded: a second is itself a BROKEN end."""

    def finish(self, end: End, detail: str = "") -> None:
        self.ends += 1
        if self.ends > 1:
            self.end, self.detail = End.BROKEN, f"ended twice: {self.end} then {end} {detail}"
            return
        self.end, self.detail = end, detail


def _typed(body: object) -> str | None:
    """The error's type when ``body`` is OpenAI's error body, else None."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("type"), str) and "message" in err:
            return str(err["type"])
    return None


def _json(r: httpx.Response) -> object:
    try:
        return r.json()
    except ValueError:
        return None


def _refused(status: int, doc: object, o: Outcome) -> None:
    """A request the server answered with an error status: typed, or broken."""
    kind = _typed(doc)
    if kind is None:
        o.finish(End.BROKEN, f"HTTP {status} without an error body")
    else:
        o.error_type = kind
        o.finish(End.ERROR, f"HTTP {status} {kind}")


def _error_event(event: dict[str, Any], data: str, finished: bool, o: Outcome) -> None:
    """A stream's error event ends it: typed and before any finish reason, or broken."""
    kind = _typed(event)
    if finished:
        o.finish(End.BROKEN, f"an error event after a finish reason: {data[:80]}")
    elif kind is None:
        o.finish(End.BROKEN, f"an untyped error event: {data[:80]}")
    else:
        o.error_type = kind
        o.finish(End.ERROR, f"error event {kind}")


def _take_choices(event: dict[str, Any], finished: dict[int, str], o: Outcome) -> bool:
    """Count the event's tokens and record its finish reasons; False (and the outcome
    broken) when a choice finishes twice."""
    for ch in event.get("choices", []):
        o.tokens += 1 if ch.get("text") else 0
        reason = ch.get("finish_reason")
        if reason is None:
            continue
        if ch["index"] in finished:
            o.finish(End.BROKEN, f"choice {ch['index']} finished twice")
            return False
        finished[ch["index"]] = reason
    return True


async def _stream(client: httpx.AsyncClient, p: Planned, o: Outcome, leave_after: int) -> None:
    body = {"model": MODEL, "prompt": p.prompt, "max_tokens": p.max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.7, "seed": p.index}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as r:
        o.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            _refused(r.status_code, _json(r), o)
            return
        finished: dict[int, str] = {}
        events = 0
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if done:
                o.finish(End.BROKEN, f"an event after [DONE]: {data[:80]}")
                return
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            events += 1
            if "error" in event:
                _error_event(event, data, bool(finished), o)
                return
            if not _take_choices(event, finished, o):
                return
            if leave_after and events >= leave_after and not finished:
                o.finish(End.LEFT, f"dropped after {events} events")
                return  # leaving the block closes the connection mid-stream
        if done and finished:
            o.finish(End.OK, ",".join(sorted(set(finished.values()))))
        else:
            o.finish(End.BROKEN, f"the stream stopped without an end ({events} events)")


async def _plain(client: httpx.AsyncClient, p: Planned, o: Outcome) -> None:
    body = {"model": MODEL, "prompt": p.prompt, "max_tokens": p.max_tokens,
            "ignore_eos": True, "temperature": 0.7, "seed": p.index}  # fmt: skip
    r = await client.post("/v1/completions", json=body)
    o.status = r.status_code
    doc = _json(r)
    if r.status_code == 200 and isinstance(doc, dict):
        choices = doc.get("choices") or []
        if choices and all(c.get("finish_reason") for c in choices):
            o.tokens = int((doc.get("usage") or {}).get("completion_tokens", 0))
            o.finish(End.OK, ",".join(sorted({str(c["finish_reason"]) for c in choices})))
            return
        o.finish(End.BROKEN, "200 without a finish reason on every choice")
        return
    _refused(r.status_code, doc, o)


async def _bad(client: httpx.AsyncClient, p: Planned, o: Outcome) -> None:
    what, body, want = BAD_BODIES[p.bad]
    if isinstance(body, str):
        r = await client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    else:
        r = await client.post("/v1/completions", json={"model": MODEL, **body})
    o.status = r.status_code
    kind = _typed(_json(r))
    if r.status_code == want and kind is not None:
        o.error_type = kind
        o.finish(End.REFUSED, what)
    else:
        o.finish(End.BROKEN, f"{what}: HTTP {r.status_code}, {'typed' if kind else 'untyped'}")


async def _one(client: httpx.AsyncClient, p: Planned, o: Outcome, timeout_s: float) -> None:
    t0 = time.monotonic()
    try:
        if p.kind is Kind.BAD:
            await asyncio.wait_for(_bad(client, p, o), timeout_s)
        elif p.kind is Kind.PLAIN:
            await asyncio.wait_for(_plain(client, p, o), timeout_s)
        elif p.kind is Kind.ABORT:
            try:
                await asyncio.wait_for(_plain(client, p, o), p.abort_after_s)
            except TimeoutError:
                if o.end is None:  # cancelled while waiting: the client left
                    o.finish(End.LEFT, f"gave up after {p.abort_after_s:.2f} s")
        else:
            leave = p.leave_after_events if p.kind is Kind.DISCONNECT else 0
            await asyncio.wait_for(_stream(client, p, o, leave), timeout_s)
    except TimeoutError:
        o.finish(End.BROKEN, f"no end within {timeout_s:g} s")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as e:
        o.finish(End.BROKEN, f"{type(e).__name__}: {e}")
    if o.end is None:
        o.finish(End.BROKEN, "no end recorded")
    o.e2e_s = time.monotonic() - t0


# --------------------------------------------------------------------- the server's side
@dataclass(frozen=True)
class RssSample:
    t_s: float
    replica: int
    rss_bytes: int
    pid: int


async def pools(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    r = await client.get("/debug/pools", timeout=60.0)
    r.raise_for_status()
    slots: list[dict[str, Any]] = r.json()["replicas"]
    return slots


def metric_sum(text: str, name: str, label: str = "") -> float:
    """The sum of the samples of ``name`` in a Prometheus text page (those whose labels
    hold ``label``, when given)."""
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if (key == name or key.startswith(name + "{")) and label in key:
            total += float(value)
    return total


@dataclass
class Soak:
    """One run's record (module doc): the plan's outcomes, the server's figures, the
    failures found."""

    settings: SoakSettings
    outcomes: list[Outcome] = field(default_factory=list)
    rss: list[RssSample] = field(default_factory=list)
    kills_sent: int = 0
    final_pools: list[dict[str, Any]] = field(default_factory=list)
    server_metrics: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)


def _samples(slots: list[dict[str, Any]], t_s: float) -> list[RssSample]:
    return [
        RssSample(t_s, x["replica"], x["report"]["rss_bytes"], x["report"]["pid"])
        for x in slots
        if x.get("report") is not None
    ]


async def _sample_rss(
    client: httpx.AsyncClient, soak: Soak, t0: float, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        # A sample missed (the server busy) is skipped: the next one comes.
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            soak.rss.extend(_samples(await pools(client), time.monotonic() - t0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), soak.settings.rss_every_s)


async def _kill(client: httpx.AsyncClient, k: Kill, soak: Soak) -> None:
    r = await client.post(f"/debug/replicas/{k.replica}/kill")
    if r.status_code == 200:
        soak.kills_sent += 1
    else:
        soak.failures.append(f"kill of replica {k.replica}: HTTP {r.status_code} {r.text[:120]}")


async def run_soak(base_url: str, s: SoakSettings) -> Soak:
    """The plan of ``s`` against the server at ``base_url`` (with ``/debug/pools`` and
    the kill endpoint), then the checks (module doc)."""
    p = plan(s)
    soak = Soak(s, [Outcome(q.index, q.kind) for q in p.requests])
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(s.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        t0 = time.monotonic()
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_rss(client, soak, t0, stop))
        tasks: list[asyncio.Task[None]] = []
        timeline: list[tuple[float, Planned | Kill]] = [(q.at_s, q) for q in p.requests]
        timeline += [(k.at_s, k) for k in p.kills]
        timeline.sort(key=lambda x: x[0])
        for at, item in timeline:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if isinstance(item, Kill):
                tasks.append(asyncio.create_task(_kill(client, item, soak)))
            else:
                o = soak.outcomes[item.index]
                o.sent_s = time.monotonic() - t0
                tasks.append(asyncio.create_task(_one(client, item, o, s.request_timeout_s)))
        _, pending = await asyncio.wait(tasks, timeout=s.settle_s + s.request_timeout_s)
        for t in pending:
            t.cancel()
        soak.wall_s = time.monotonic() - t0
        await _settle(client, soak, t0)
        stop.set()
        await sampler
        metrics = (await client.get("/metrics")).text
        for name in ("refserve:replica_deaths_total", "refserve:replica_restarts_total",
                     "refserve:replica_failed_requests_total",
                     "refserve:replica_restarted_requests_total"):  # fmt: skip
            soak.server_metrics[name.split(":")[1]] = metric_sum(metrics, name)
        soak.server_metrics["aborted_requests"] = metric_sum(
            metrics, "vllm:request_success_total", 'finished_reason="abort"'
        )
    soak.failures.extend(check(soak, p))
    return soak


async def _settle(client: httpx.AsyncClient, soak: Soak, t0: float) -> None:
    """Wait until every live replica holds no request (up to ``settle_s``), then read
    the pools once more: the final state the pool promise is checked on."""
    end = time.monotonic() + soak.settings.settle_s
    slots: list[dict[str, Any]] = []
    while True:
        try:
            slots = await pools(client)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            soak.failures.append(f"/debug/pools: {type(e).__name__}: {e}")
            return
        busy = [x for x in slots if x["report"] and x["report"]["live_requests"]]
        if not busy or time.monotonic() > end:
            break
        await asyncio.sleep(0.5)
    soak.final_pools = slots
    soak.rss.extend(_samples(slots, time.monotonic() - t0))


# --------------------------------------------------------------------- the promises
def check(soak: Soak, p: Plan) -> list[str]:
    """Each broken promise (module doc), one line each (a few examples per promise)."""
    s = soak.settings
    out = _check_ends(soak) + _check_pools(soak)
    for pid, growth in rss_growth(soak).items():
        if growth > s.rss_bound_mib * (1 << 20):
            out.append(f"memory: process {pid} grew {growth / (1 << 20):.1f} MiB after the "
                       f"warm-up (bound {s.rss_bound_mib:g} MiB)")  # fmt: skip
    used = budget_used(soak)
    if used > 1.0:
        out.append(f"error budget: {used:.0%} of it used ({s.error_budget:.0%} of requests kept)")
    if p.kills and soak.kills_sent == 0:
        out.append("faults: kills were planned and none was made")
    return out


def _check_ends(soak: Soak) -> list[str]:
    """Every request ended exactly once, with a result or a typed error."""
    out: list[str] = []
    broken = [o for o in soak.outcomes if o.end is End.BROKEN or o.ends != 1]
    for o in broken[:10]:
        out.append(f"ends: request {o.index} ({o.kind}): {o.detail}")
    if len(broken) > 10:
        out.append(f"ends: and {len(broken) - 10} more requests without one typed end")
    return out


def _check_pools(soak: Soak) -> list[str]:
    """Every surviving replica's pools hold to the spec, with nothing held at the end."""
    out: list[str] = []
    alive = [x for x in soak.final_pools if x.get("report") is not None]
    if not alive:
        out.append("pools: no live replica to check at the end")
    for slot in alive:
        rep, i = slot["report"], slot["replica"]
        for v in rep["violations"][:5]:
            out.append(f"pools: replica {i}: {v}")
        if rep["live_requests"]:
            out.append(f"pools: replica {i} still holds {len(rep['live_requests'])} requests "
                       f"after the load stopped: {rep['live_requests'][:5]}")  # fmt: skip
        if rep["tables"] or rep["free_blocks"] != rep["num_blocks"]:
            held = rep["num_blocks"] - rep["free_blocks"]
            out.append(f"pools: replica {i}: {rep['tables']} tables, {held} blocks held at the end")
    return out


def rss_growth(soak: Soak) -> dict[int, int]:
    """Per process: its largest RSS sample after the warm-up minus its first sample at or
    after the warm-up (a process that started after the warm-up, a restarted Ray actor,
    counts from its first sample)."""
    start = soak.settings.warmup_fraction * soak.settings.duration_s
    per: dict[int, list[RssSample]] = {}
    for x in soak.rss:
        if x.t_s >= start and x.rss_bytes:
            per.setdefault(x.pid, []).append(x)
    return {pid: max(x.rss_bytes for x in xs) - xs[0].rss_bytes for pid, xs in per.items()}


def _kept(soak: Soak) -> list[Outcome]:
    return [o for o in soak.outcomes if o.end in (End.OK, End.ERROR)]


def budget_used(soak: Soak) -> float:
    kept = _kept(soak)
    errors = sum(o.end is End.ERROR for o in kept)
    rate = errors / len(kept) if kept else 0.0
    return rate / soak.settings.error_budget if soak.settings.error_budget else float(errors > 0)


def _error_kinds(soak: Soak) -> dict[str, int]:
    """Typed errors by status (or "stream event") and type."""
    errors: dict[str, int] = {}
    for o in soak.outcomes:
        if o.end is End.ERROR:
            key = f"{'stream event' if o.status == 200 else o.status} {o.error_type}"
            errors[key] = errors.get(key, 0) + 1
    return errors


def _quantile(xs: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of sorted ``xs`` (nearest rank), rounded; None when empty."""
    return round(xs[min(len(xs) - 1, int(len(xs) * q))], 3) if xs else None


def _rates(soak: Soak) -> dict[str, Any]:
    """Requests and tokens per second over the wall time; goodput, a result within the
    end-to-end SLO; the error rate of the requests kept."""
    s, wall = soak.settings, max(soak.wall_s, 1e-9)
    kept = _kept(soak)
    good = [o for o in kept if o.end is End.OK and o.e2e_s is not None and o.e2e_s <= s.slo_e2e_s]
    errors_kept = sum(o.end is End.ERROR for o in kept)
    return {
        "throughput_rps": round(sum(o.end is not None for o in soak.outcomes) / wall, 3),
        "tokens_per_s": round(sum(o.tokens for o in soak.outcomes) / wall, 2),
        "goodput_rps": round(len(good) / wall, 3),
        "error_rate": round(errors_kept / len(kept), 4) if kept else 0.0,
    }


def summary(soak: Soak) -> dict[str, Any]:
    """The run's figures (module doc), as the JSON holds them."""
    e2e = sorted(o.e2e_s for o in soak.outcomes if o.end is End.OK and o.e2e_s is not None)
    return {
        "requests": len(soak.outcomes),
        "kinds": {k.value: sum(o.kind is k for o in soak.outcomes) for k in Kind},
        "ends": {e.value: sum(o.end is e for o in soak.outcomes) for e in End},
        "errors": _error_kinds(soak),
        "wall_s": round(soak.wall_s, 2),
        **_rates(soak),
        "ok_e2e_p50_s": _quantile(e2e, 0.5),
        "ok_e2e_p99_s": _quantile(e2e, 0.99),
        "error_budget_used": round(budget_used(soak), 4),
        "kills_sent": soak.kills_sent,
        "server": soak.server_metrics,
        "rss_growth_mib": {str(k): round(v / (1 << 20), 2) for k, v in rss_growth(soak).items()},
        "rss_peak_mib": round(max((x.rss_bytes for x in soak.rss), default=0) / (1 << 20), 1),
        "final_pools": soak.final_pools,
    }


def report_doc(soak: Soak, provenance: Provenance, backend: str, note: str = "") -> dict[str, Any]:
    """The JSON of a run; its provenance as recorded when it started."""
    settings = asdict(soak.settings)
    return {
        **provenance.header(FORMAT),
        "backend": backend,
        "note": note,
        "settings": settings,
        "summary": summary(soak),
        "failures": soak.failures,
        "passed": not soak.failures,
        "rss_samples": [asdict(x) for x in soak.rss],
    }


# --------------------------------------------------------------------- the real server
def start_server(
    s: SoakSettings, backend: str, model: str, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """``refserve serve --replicas N --fault-endpoints`` on a free loopback port; its
    process and address, once it says it serves."""
    cmd = [
        sys.executable, "-m", "refserve.cli.main", "serve", "--model", model,
        "--served-model-name", MODEL, "--replicas", str(s.replicas), "--backend", backend,
        "--port", "0", "--fault-endpoints", "--max-replica-restarts", "1000",
        "--torch-threads", "1", "--drain-timeout", "10",
    ]  # fmt: skip
    out = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out)
    assert proc.stdout is not None
    deadline = time.monotonic() + 300.0
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = _SERVING.search(line.decode(errors="replace"))
        if m:
            return proc, m.group(1)
    proc.kill()
    raise InvalidArgument(f"soak: the server did not start (its log: {log})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m refserve.conformance.bench.soak", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second offered")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-every", type=float, default=45.0, help="mean seconds between kills")
    ap.add_argument("--backend", choices=("inprocess", "ray"), default="inprocess")
    ap.add_argument("--model", default="tiny-trained")
    ap.add_argument("--rss-bound-mib", type=float, default=64.0)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--note", default="", help="a line the report prints (the load, a caveat)")
    args = ap.parse_args(argv)
    s = SoakSettings(duration_s=args.duration, rate_rps=args.rate, seed=args.seed,
                     kill_every_s=args.kill_every, rss_bound_mib=args.rss_bound_mib)  # fmt: skip
    # What reruns it (the note, which changes no figure, left out).
    command = shlex.join(
        ["python", "-m", "refserve.conformance.bench.soak", "--duration", f"{s.duration_s:g}",
         "--rate", f"{s.rate_rps:g}", "--seed", str(s.seed), "--kill-every",
         f"{s.kill_every_s:g}", "--backend", args.backend, "--model", args.model,
         "--rss-bound-mib", f"{s.rss_bound_mib:g}", "--json", str(args.json)]
    )  # fmt: skip
    provenance = Provenance.start(command)
    log = args.json.with_suffix(".server.log")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(s, args.backend, args.model, log)
    try:
        soak = asyncio.run(run_soak(url, s))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
    if rc != 0:
        soak.failures.append(f"server: exit status {rc} after SIGTERM (want 0: drained)")
    doc = report_doc(soak, provenance, args.backend, args.note)
    args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    sm = doc["summary"]
    restarts = sm["server"].get("replica_restarts_total")
    print(f"soak: {sm['requests']} requests in {sm['wall_s']} s, ends {sm['ends']}, "
          f"goodput {sm['goodput_rps']} req/s, error budget used {sm['error_budget_used']:.0%}, "
          f"kills {sm['kills_sent']}, restarts {restarts}")  # fmt: skip
    for f in soak.failures:
        print(f"soak: FAILED {f}")
    return 0 if not soak.failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
