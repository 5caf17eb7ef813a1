"""``bench-serve --fit`` held to a synthetic server whose true costs are known.

The synthetic server below is a small discrete-event model written here, apart from the
simulator: continuous batching (every running request decodes each step; the prompts
added before a step are prefilled whole in it), a step of ``a + f*[P>0] + b*P + c*D``
ms times a seeded scatter factor (median 1), the loop's gap after each step, per
request a known front, wake, handoff and HTTP transport, and per later token a known
delivery to the handler (in order). It writes what a real run
leaves: the server's step records and per-request checkpoints, and the client's
records. The fit must recover the terms and the overheads, and its replay (refserve's
scheduler on the simulator) must predict the synthetic server's TTFT and TBT P50/P90
and goodput within :data:`TOLERANCE`. A fit with a term missing is caught.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from refserve.serve.bench import Record, Slo
from refserve.serve.fit import (
    Comparison,
    StepSample,
    compare,
    fit_steps,
    model_of,
    replay,
    replay_pooled,
)
from refserve.serve.request_timing import RequestTiming

#: How close the replay must come to the synthetic server (relative error).
TOLERANCE = 0.15
REPLAYS = 4
TRUE = {"a": 1.0, "f": 6.0, "b": 0.03, "c": 3.0}
GAP_MS = (0.2, 1.0)  # uniform
FRONT_MS, WAKE_MS, HANDOFF_MS, TRANSPORT_MS = (0.05, 0.15), (0.0, 1.0), (0.5, 2.5), (2.0, 8.0)
#: Each later token, from its step end to the handler: mostly at once, one in
#: :data:`STALL_P` after a stall (a server's event loop waiting on the GIL).
DELIVERY_MS, STALL_MS, STALL_P = (0.0, 0.5), (4.0, 20.0), 0.2
SLO = Slo(ttft_ms=30.0, tpot_ms=6.0)  # binding for part of the requests
SCHED: dict[str, Any] = {
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 256,
    "block_size": 16,
    "num_blocks": 8192,
    "max_model_len": 4096,
    "enable_prefix_caching": False,
    "enable_chunked_prefill": True,
    "policy": "decode-first",
    "replicas": 1,
    "router": None,
}


@dataclass
class _Live:
    rec: Record
    added_ms: float
    left: int  # tokens still to produce
    transport_ms: float
    handoff_ms: float
    timing: dict[str, float] = field(default_factory=dict)
    ends: list[float] = field(default_factory=list)  # the steps of its tokens
    handler: list[float] = field(default_factory=list)  # the handler holding each

    def deliver(self, end: float, delay: float) -> None:
        """The handler takes up a token of the step ending at ``end`` once it handled the
        token before, and holds it ``delay`` later; the client half the transport after."""
        self.ends.append(end)
        self.handler.append(max(end, self.handler[-1] if self.handler else end) + delay)
        self.rec.chunk_times_s.append((self.handler[-1] + self.transport_ms / 2) / 1e3)
        self.left -= 1


def _step_ms(p: int, d: int, rng: random.Random) -> float:
    ms = TRUE["a"] + TRUE["b"] * p + TRUE["c"] * d + (TRUE["f"] if p else 0.0)
    return ms * math.exp(rng.gauss(0.0, 0.35))  # median 1: the terms are the median


def synthetic_run(
    n: int = 400, rate: float = 8.0, seed: int = 1
) -> tuple[list[StepSample], list[RequestTiming], list[Record], float]:
    """The synthetic server's step records, per-request checkpoints and the client's
    records (times in ms inside, the records' units outside), and the run's span (s)."""
    rng = random.Random(seed)
    t = 0.0
    pending: list[tuple[float, _Live, int]] = []  # added at, request, prompt tokens
    for i in range(n):
        t += rng.expovariate(rate) * 1e3
        prompt, out = rng.randint(16, 400), rng.randint(4, 16)
        tr, front = rng.uniform(*TRANSPORT_MS), rng.uniform(*FRONT_MS)
        handoff = rng.uniform(*HANDOFF_MS)
        rec = Record(f"r{i}", t / 1e3, sent_s=t / 1e3, prompt_tokens=prompt, completion_tokens=out)
        live = _Live(rec, 0.0, out, tr, handoff)
        live.timing = {"received": t + tr / 2, "queued": t + tr / 2 + front}
        pending.append((live.timing["queued"], live, prompt))
    steps: list[StepSample] = []
    timings: list[RequestTiming] = []
    running: list[_Live] = []
    clock = 0.0  # when the loop is free (after a step and its gap)
    last_end: float | None = None
    queue = sorted(pending, key=lambda x: x[0])
    while queue or running:
        if not running and queue and queue[0][0] > clock:
            # Idle: the next request wakes the thread.
            clock = queue[0][0] + rng.uniform(*WAKE_MS)
            last_end = None
        start = clock
        joining = []
        while queue and queue[0][0] <= start:
            _, live, prompt = queue.pop(0)
            live.added_ms = start
            joining.append((live, prompt))
        p = sum(pr for _, pr in joining)
        d = len(running)
        ms = _step_ms(p, d, rng)
        end = start + ms
        gap = None if last_end is None else start - last_end
        steps.append(StepSample(ms, p, d, gap, start / 1e3))
        for live in running:
            stalled = rng.random() < STALL_P
            live.deliver(end, rng.uniform(*(STALL_MS if stalled else DELIVERY_MS)))
        for live, _ in joining:
            live.deliver(end, live.handoff_ms)
            live.rec.first_token_s = live.rec.chunk_times_s[0]
            running.append(live)
        for live in [x for x in running if x.left == 0]:
            running.remove(live)
            live.rec.status = "ok"
            live.rec.finish_s = live.rec.chunk_times_s[-1]
            tm = live.timing
            e0, h0 = live.ends[0], live.handler[0]
            timings.append(
                RequestTiming(
                    len(timings),
                    tm["received"] / 1e3,
                    tm["queued"] / 1e3,
                    live.added_ms / 1e3,
                    h0 / 1e3,
                    e0 - live.added_ms,
                    live.rec.id,
                    engine_token_ms=tuple(t - e0 for t in live.ends),
                    handler_token_ms=tuple(t - h0 for t in live.handler),
                    added_s=live.added_ms / 1e3,
                )
            )
        last_end = end
        clock = end + rng.uniform(*GAP_MS)
    records = [x[1].rec for x in pending]
    span = max(r.finish_s or 0.0 for r in records)
    return steps, timings, records, span


def _errors(comparisons: tuple[Comparison, ...]) -> dict[str, float]:
    wanted = ("TTFT P50", "TTFT P90", "TBT P50", "TBT P90", "goodput")
    return {c.metric: c.error for c in comparisons if c.metric in wanted and c.error is not None}


def _predict(terms: tuple[str, ...] = ("a", "f", "b", "c")) -> dict[str, float]:
    steps, timings, records, span = synthetic_run()
    model = model_of(steps, SCHED, records, timings, terms)
    simulated = replay_pooled(records, model, SCHED, REPLAYS)
    return _errors(compare(records, simulated, SLO, span, REPLAYS))


def test_the_fit_recovers_the_known_terms() -> None:
    steps, timings, records, _ = synthetic_run()
    fit = fit_steps(steps)
    got = {t.name: t for t in fit.terms}
    for name, true in TRUE.items():
        term = got[name]
        assert term.stderr_ms is not None
        # Within 4 standard errors and 15 %: a wrong term would be far off both.
        assert abs(term.value_ms - true) <= max(4 * term.stderr_ms, 0.15 * true), (name, term)
        assert term.r2_drop is not None and term.r2_drop > 0, name  # each term earns its place
    assert got["gap"].value_ms == pytest.approx(sum(GAP_MS) / 2, rel=0.1)
    assert fit.noise is not None
    model = model_of(steps, SCHED, records, timings)
    medians = {o.name: o.p50_ms for o in model.overhead_terms}
    mid = {"front": FRONT_MS, "wake": WAKE_MS, "handoff": HANDOFF_MS, "transport": TRANSPORT_MS}
    for name, (lo, hi) in mid.items():
        assert medians[name] == pytest.approx((lo + hi) / 2, rel=0.2, abs=0.05), name
    # The delivery's true median and P90 (the mixture's), a little above where a stall
    # also holds the token after it back.
    (delivery,) = (o for o in model.overhead_terms if o.name == "delivery")
    true_p50 = DELIVERY_MS[1] * 0.5 / (1 - STALL_P)
    true_p90 = STALL_MS[0] + (STALL_MS[1] - STALL_MS[0]) * (0.9 - (1 - STALL_P)) / STALL_P
    assert delivery.p50_ms == pytest.approx(true_p50, rel=0.3)
    assert delivery.p90_ms == pytest.approx(true_p90, rel=0.15)


def test_the_replay_predicts_the_synthetic_server() -> None:
    errors = _predict()
    assert set(errors) == {"TTFT P50", "TTFT P90", "TBT P50", "TBT P90", "goodput"}
    bad = {k: f"{v:+.0%}" for k, v in errors.items() if abs(v) > TOLERANCE}
    assert not bad, bad


@pytest.mark.parametrize("missing", ["f", "c"])
def test_a_model_without_a_true_term_is_caught(missing: str) -> None:
    terms = tuple(t for t in ("a", "f", "b", "c") if t != missing)
    errors = _predict(terms)
    assert any(abs(v) > TOLERANCE for v in errors.values()), errors


def test_the_replay_without_the_overheads_is_caught() -> None:
    """The simulator alone (the old fit's model) misses the time around the engine."""
    steps, timings, records, span = synthetic_run()
    model = dataclasses.replace(model_of(steps, SCHED, records, timings), overheads=())
    errors = _errors(compare(records, replay(records, model, SCHED), SLO, span))
    assert errors["TTFT P50"] < -TOLERANCE, errors


def test_the_replay_without_each_tokens_delivery_is_caught() -> None:
    """Every later token delivered as the first one was (the fit before it measured
    each): the simulated token gaps are the bare step gaps, and the TBT P90 falls short."""
    steps, timings, records, span = synthetic_run()
    model = model_of(steps, SCHED, records, timings)
    assert len(model.deliveries) > len(records)  # measured per token, not per request
    bare = dataclasses.replace(
        model, overheads=tuple(dataclasses.replace(o, delivery_ms=()) for o in model.overheads)
    )
    errors = _errors(compare(records, replay_pooled(records, bare, SCHED, REPLAYS), SLO, span))
    assert errors["TBT P90"] < -TOLERANCE, errors
