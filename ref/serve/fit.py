"""``refserve bench-serve --fit``: calibrate the simulator from a live server, then check it.

What a client measures is more than the steps the simulator models. The fit measures
each part and models it:

1. **The step** (the server's per-step records, ``GET /debug/steps?since=K``): the step's
   wall time against its prefill tokens ``P`` and decodes ``D`` is fitted by least squares
   to ``a + f*[P>0] + b*P + c*D`` ms (``f``: the fixed cost more of a batch with a
   prefill), as the conditional median (least absolute deviations: the long tail of a
   loaded machine's steps is item 3's, not the terms'). A coefficient that comes out
   negative is fixed at 0 and the others refitted (a cost cannot be negative). Each
   term is reported with its standard error (bootstrap) and the share of the fit's
   R1, the median fit's R^2, lost without it.
2. **Between steps**: the loop's gap from one step's end to the next one's start, when it
   went from one to the other without idling (handing the outputs to the HTTP side,
   its commands, the GIL), is the cost's ``g``: the simulator moves its clock on by a
   gap drawn from the measured ones after each step, after the step's tokens are
   stamped (the tokens left at the step's end; only the next step waits).
3. **The step's scatter**: each measured step over what the model says is a factor; the
   simulator multiplies each step's modelled time by one drawn from those
   (ref/sim/noise.py; a step with prefill from its own shape's factors). Without it
   every simulated token gap is the modelled step, and the TBT P90 comes out far below a
   real server's on a busy machine.
4. **Around the engine, per request** (``GET /debug/requests``, matched to the client's
   records by the ``X-Request-Id`` the bench sends): the handler's work before the
   engine sees the request (parsing, tokenizing: *front*), the time from the step that
   produced the first token to the handler holding it (*handoff*), and the HTTP time
   outside the handler (*transport*: the client's TTFT beyond the server's). A replayed
   request arrives at the scheduler ``front + transport/2`` after it was sent and its
   tokens reach the client ``handoff + transport/2`` after their step: one measured
   (front, handoff, transport) triple drawn per request, seeded (the server cannot
   tell the inbound half of the HTTP time from the outbound one: each gets half). And
   *wake*: from the hand-off to the engine thread adding the request, measured on the
   requests that found no step running (the step in progress is the simulator's to
   model; the time an idle thread takes to wake on a busy machine is not): a replayed
   request reaches the scheduler that much later too.
5. **The delivery of each later token** (the server's per-request token times, engine
   side and handler side): the handler does not hold every token as soon as its step
   ends (the engine thread and the event loop share the GIL; a token that completes no
   character waits for the next in the text stream). The handler is modelled as one
   queue per request: an output is taken up once its step has ended and the output
   before it was handled, and is handled a delay after that. Each output after the
   first is measured as that delay (its handler time less the later of its step's end
   and the previous output's handler time), and a replayed token after the first is
   handled one such delay, drawn from all of them (seeded), after the later of its
   step's end and the previous token's handling; the client holds it half the transport
   later. Without it every simulated token gap is a step gap, and the TBT P90 comes out
   12-17 % below the clients' (measured); with each delay counted from its step's end
   instead, a wait behind the previous output is counted twice, and the TBT P90 came
   out up to 15 % above.

Then the same requests (their send times, their token counts from ``usage``) are
replayed (:data:`REPLAYS` times, seeded, pooled) in the simulator with the server's
scheduler settings, on as many replicas as the server has behind its router (the
cluster simulator, the same router policy), and the simulated TTFT and TBT
percentiles and goodput are compared with the measured ones.
The scheduler itself runs in the replay; only time is modelled.

What is still left out shows as the error: step times whose slowness comes in runs (a
busy machine slows many steps in a row, the noise draws them independently), and
deliveries that come in runs too (they are drawn independently per token).
The fit needs refserve's debug endpoints; another server gives a clear error.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from refserve.cluster.router import RoutingPolicy
from refserve.cluster.sim import simulate_cluster
from refserve.core.config import PolicyName, SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.request_metrics import RequestMetrics
from refserve.core.scheduler import Scheduler
from refserve.errors import InvalidArgument, RefserveError
from refserve.serve.bench import Record, Slo
from refserve.serve.request_timing import RequestTiming
from refserve.sim.metrics import percentile
from refserve.sim.noise import StepNoise
from refserve.sim.simulator import simulate
from refserve.sim.trace import TraceRequest
from refserve.sim.workloads import Workload


class FitError(RefserveError):
    """The server's step records could not be read or fitted."""


#: The step model's regression terms, in column order, and what each one charges.
STEP_TERMS: dict[str, str] = {
    "a": "every step",
    "f": "a step with prefill (P>0)",
    "b": "per prefill token (P)",
    "c": "per decode (D)",
}
GAP_TERM = "gap"
DEFAULT_SLO = Slo()
#: How many quantiles of the measured step scatter the noise model keeps (per shape).
NOISE_QUANTILES = 200
#: Reweightings of the median fit, and the resampled refits behind a term's std err.
MEDIAN_ITERATIONS = 40
BOOTSTRAP_ROUNDS = 30
#: Replays pooled into the simulated figures (:func:`replay_pooled`).
REPLAYS = 8
#: Resamples behind a measured figure's interval (:class:`Comparison`).
INTERVAL_ROUNDS = 200


@dataclass(frozen=True)
class StepSample:
    duration_ms: float
    num_prefill_tokens: int
    num_decodes: int
    gap_ms: float | None = None  # since the previous step ended, when back to back
    start_s: float | None = None  # on the server's clock


@dataclass(frozen=True)
class Term:
    """One fitted term: its value, its standard error, and the R^2 the step fit loses
    when it is left out and the rest refitted (None: not a regression term)."""

    name: str
    meaning: str
    value_ms: float
    stderr_ms: float | None
    r2_drop: float | None


@dataclass(frozen=True)
class StepFit:
    cost: StepCost  # the gap included in ``a``
    terms: tuple[Term, ...]
    r_squared: float
    num_steps: int
    noise: StepNoise | None


@dataclass(frozen=True)
class RequestOverhead:
    """One request's measured time outside the engine (ms), as the replay applies it."""

    front_ms: float
    handoff_ms: float
    transport_ms: float
    wake_ms: float = 0.0
    #: Each later output's delay from its token's step end to the handler (module doc, 5).
    delivery_ms: tuple[float, ...] = ()

    @property
    def admit_ms(self) -> float:
        """From the client's send to the request reaching the scheduler."""
        return self.front_ms + self.wake_ms + self.transport_ms / 2

    @property
    def deliver_ms(self) -> float:
        """From a token's step end to the client holding it."""
        return self.handoff_ms + self.transport_ms / 2


@dataclass(frozen=True)
class OverheadTerm:
    name: str
    meaning: str
    p50_ms: float | None
    p90_ms: float | None
    num_requests: int


@dataclass(frozen=True)
class ServingModel:
    """Everything the replay models: the step, its scatter, the time around the engine,
    and the cluster's shape."""

    step: StepFit
    overheads: tuple[RequestOverhead, ...]
    replicas: int = 1
    router: str | None = None

    @property
    def deliveries(self) -> tuple[float, ...]:
        """Every measured delivery of a later output (module doc, 5), pooled."""
        return tuple(d for o in self.overheads for d in o.delivery_ms)

    @property
    def overhead_terms(self) -> tuple[OverheadTerm, ...]:
        o = self.overheads
        n = len(o)
        rows = (
            ("front", "handler before the engine (parse, tokenize)", [x.front_ms for x in o], n),
            ("wake", "engine thread idle to the request added", [x.wake_ms for x in o], n),
            ("handoff", "first token's step end to the handler", [x.handoff_ms for x in o], n),
            (
                "delivery",
                "a later token's step end to the handler",
                list(self.deliveries),
                sum(1 for x in o if x.delivery_ms),
            ),
            ("transport", "HTTP outside the handler, both ways", [x.transport_ms for x in o], n),
        )
        return tuple(
            OverheadTerm(name, what, percentile(xs, 50), percentile(xs, 90), num)
            for name, what, xs, num in rows
        )


@dataclass(frozen=True)
class Comparison:
    """A measured figure against the replay's. ``measured_lo``/``measured_hi``: the
    measured figure's 90 % bootstrap interval (the run's requests resampled): how far
    the figure itself moves with which requests happened to be slow, the yardstick of a
    P99 taken from a few requests."""

    metric: str
    measured: float | None
    simulated: float | None
    unit: str = "ms"
    measured_lo: float | None = None
    measured_hi: float | None = None

    @property
    def error(self) -> float | None:
        if self.measured is None or self.simulated is None or self.measured == 0:
            return None
        return (self.simulated - self.measured) / self.measured


@dataclass(frozen=True)
class FitResult:
    model: ServingModel
    comparisons: tuple[Comparison, ...]

    @property
    def cost(self) -> StepCost:
        return self.model.step.cost

    @property
    def num_steps(self) -> int:
        return self.model.step.num_steps

    @property
    def r_squared(self) -> float:
        return self.model.step.r_squared


@dataclass(frozen=True)
class FitStart:
    """Where the run's records begin in the server's rings."""

    step: int
    request: int


# --------------------------------------------------------------------- reading
def fit_start(client: httpx.Client) -> FitStart:
    doc = _debug(client, "/debug/steps?last=1")
    steps = doc.get("steps")
    index = -1
    if isinstance(steps, list) and steps and isinstance(steps[-1], dict):
        got = steps[-1].get("index")
        index = got if isinstance(got, int) else -1
    # A since past every index: only the last index comes back, not the whole ring.
    reqs = _debug(client, f"/debug/requests?since={1 << 62}", required=False)
    last = reqs.get("last_index") if reqs else None
    return FitStart(index + 1, (last if isinstance(last, int) else -1) + 1)


def _debug(client: httpx.Client, path: str, *, required: bool = True) -> dict[str, Any]:
    try:
        r = client.get(path)
    except httpx.HTTPError as e:
        raise FitError(f"--fit: GET {path}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        if not required:
            return {}
        raise FitError(
            f"--fit needs the server's per-step records (refserve serve's GET /debug/steps); "
            f"{path} answered {r.status_code}"
        )
    try:
        doc = r.json()
    except ValueError:
        raise FitError(f"--fit: {path} did not answer JSON") from None
    if not isinstance(doc, dict):
        raise FitError(f"--fit: {path} did not answer a JSON object")
    return doc


def read_steps(client: httpx.Client, since: int) -> tuple[list[StepSample], dict[str, Any]]:
    """The run's step records, and the server's scheduler settings and cluster shape."""
    doc = _debug(client, f"/debug/steps?since={since}")
    samples: list[StepSample] = []
    for s in doc.get("steps") or []:
        try:
            gap = s.get("gap_ms")
            samples.append(
                StepSample(
                    float(s["duration_ms"]),
                    int(s["num_prefill_tokens"]),
                    int(s["num_decodes"]),
                    None if gap is None else float(gap),
                    None if s.get("start_s") is None else float(s["start_s"]),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise FitError(f"--fit: a step record is malformed: {str(s)[:200]}") from None
    sched = doc.get("scheduler")
    shape = {k: doc.get(k) for k in ("replicas", "router")}
    return samples, {**(sched if isinstance(sched, dict) else {}), **shape}


def read_requests(client: httpx.Client, since: int) -> list[RequestTiming]:
    """The server's checkpoints of the run's requests (ref/serve/request_timing.py) that
    the client named; none from a server without ``/debug/requests``."""
    doc = _debug(client, f"/debug/requests?since={since}", required=False)
    out = []
    for t in doc.get("requests") or []:
        try:
            rt = RequestTiming(**t)
            rt = dataclasses.replace(
                rt,
                engine_token_ms=tuple(rt.engine_token_ms),
                handler_token_ms=tuple(rt.handler_token_ms),
            )
        except TypeError:
            raise FitError(f"--fit: a request record is malformed: {str(t)[:200]}") from None
        if rt.client_id is not None:
            out.append(rt)
    return out


# --------------------------------------------------------------------- fitting
def _median_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least absolute deviations (the conditional median) by iteratively reweighted
    least squares, every coefficient >= 0 (a negative one is fixed at 0 and the rest
    refitted). The median, not the mean: a loaded machine's step times have a long tail
    (a step that waited for a core), which would drag a least-squares fit's terms;
    the tail is the scatter's to model (module doc, 3)."""
    keep = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    floor = 1e-3 * max(float(np.median(np.abs(y))), 1e-9)
    while keep:
        xs = x[:, keep]
        w = np.ones(len(y))
        sol = np.zeros(len(keep))
        for _ in range(MEDIAN_ITERATIONS):
            sw = np.sqrt(w)
            sol = np.linalg.lstsq(xs * sw[:, None], y * sw, rcond=None)[0]
            w = 1.0 / np.maximum(np.abs(y - xs @ sol), floor)
        coef = np.zeros(x.shape[1])
        coef[keep] = sol
        negative = [k for k in keep if coef[k] < 0]
        if not negative:
            break
        keep = [k for k in keep if k not in negative]
        coef[negative] = 0.0
    return coef


def _r1(y: np.ndarray, pred: np.ndarray) -> float:
    """The median fit's R^2 (Koenker and Machado's R1): the share of the absolute
    deviation around the median that the model explains."""
    total = float(np.abs(y - np.median(y)).sum())
    return 1.0 - float(np.abs(y - pred).sum()) / total if total > 0 else 1.0


def _column(term: str, s: StepSample) -> float:
    if term == "a":
        return 1.0
    if term == "f":
        return 1.0 if s.num_prefill_tokens else 0.0
    return float(s.num_prefill_tokens if term == "b" else s.num_decodes)


def _quantiles(xs: Sequence[float]) -> tuple[float, ...]:
    """At most :data:`NOISE_QUANTILES` evenly spaced order statistics of ``xs``."""
    xs = sorted(x for x in xs if x > 0 and math.isfinite(x))
    n = min(NOISE_QUANTILES, len(xs))
    return tuple(xs[min(len(xs) - 1, int((i + 0.5) * len(xs) / n))] for i in range(n))


def _gap_quantiles(gaps: Sequence[float]) -> tuple[float, ...]:
    xs = sorted(g for g in gaps if math.isfinite(g))
    n = min(NOISE_QUANTILES, len(xs))
    return tuple(xs[min(len(xs) - 1, int((i + 0.5) * len(xs) / n))] for i in range(n))


def _check_terms(terms: Sequence[str], num_samples: int) -> None:
    unknown = [t for t in terms if t not in STEP_TERMS]
    if unknown or not terms or len(set(terms)) != len(terms):
        raise InvalidArgument(f"step terms must be distinct ones of {', '.join(STEP_TERMS)}")
    if num_samples < len(terms) + 1:
        raise FitError(f"--fit: {num_samples} step records; at least {len(terms) + 1} needed")


def _fitted_terms(
    terms: Sequence[str], x: np.ndarray, y: np.ndarray, coef: np.ndarray, seed: int
) -> list[Term]:
    """Each regression term with its bootstrap standard error and the R1 lost without it."""
    r1 = _r1(y, x @ coef)
    rng = np.random.default_rng(seed)
    boots = np.array(
        [_median_fit(x[i], y[i]) for i in rng.integers(0, len(y), (BOOTSTRAP_ROUNDS, len(y)))]
    )
    fitted: list[Term] = []
    for k, t in enumerate(terms):
        others = [j for j in range(len(terms)) if j != k]
        rest = _r1(y, x[:, others] @ _median_fit(x[:, others], y)) if others else 0.0
        se = float(boots[:, k].std(ddof=1)) if BOOTSTRAP_ROUNDS > 1 else None
        fitted.append(Term(t, STEP_TERMS[t], float(coef[k]), se, r1 - rest))
    return fitted


def _gap_term(gaps: Sequence[float]) -> Term:
    """The loop's mean time after a step, with the standard error of that mean."""
    gap = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - gap) ** 2 for g in gaps) / max(1, len(gaps) - 1))
    what = "the loop after a step (mean), before the next"
    return Term(GAP_TERM, what, gap, sd / math.sqrt(len(gaps)), None)


def _step_noise(
    samples: Sequence[StepSample], cost: StepCost, gaps: Sequence[float], seed: int
) -> StepNoise | None:
    """The measured over the modelled step time, pooled and for prefill steps apart."""
    decode: list[float] = []
    prefill: list[float] = []
    for s in samples:
        m = cost.step_ms(s.num_prefill_tokens, s.num_decodes)
        if m > 0:
            (prefill if s.num_prefill_tokens else decode).append(s.duration_ms / m)
    pooled = _quantiles(decode + prefill)
    if not pooled:
        return None
    return StepNoise(pooled, seed, _quantiles(prefill), _gap_quantiles(gaps))


def fit_steps(
    samples: Sequence[StepSample],
    terms: Sequence[str] = tuple(STEP_TERMS),
    *,
    noise: bool = True,
    seed: int = 0,
) -> StepFit:
    """The step model over ``samples`` (module doc, 1-3) with the regression ``terms``
    (a subset of :data:`STEP_TERMS`; those left out are 0). Each term's standard error
    is the spread of its value over :data:`BOOTSTRAP_ROUNDS` refits on resampled steps
    (seeded); its R^2 lost is what R1 (:func:`_r1`) drops by when it is left out."""
    _check_terms(terms, len(samples))
    x = np.array([[_column(t, s) for t in terms] for s in samples], dtype=np.float64)
    y = np.array([s.duration_ms for s in samples], dtype=np.float64)
    coef = _median_fit(x, y)
    fitted = _fitted_terms(terms, x, y, coef, seed)
    gaps = [max(0.0, s.gap_ms) for s in samples if s.gap_ms is not None]
    if gaps:
        fitted.append(_gap_term(gaps))
    values = dict(zip(terms, (max(0.0, float(v)) for v in coef), strict=True))
    cost = StepCost(
        a=values.get("a", 0.0),
        b=values.get("b", 0.0),
        c=values.get("c", 0.0),
        f=values.get("f", 0.0),
        g=sum(gaps) / len(gaps) if gaps else 0.0,
    )
    step_noise = _step_noise(samples, cost, gaps, seed) if noise else None
    return StepFit(cost, tuple(fitted), _r1(y, x @ coef), len(samples), step_noise)


@dataclass(frozen=True)
class _Busy:
    """The steps' spans on the server's clock (s), each with the loop's mean time after
    it, sorted by start."""

    spans: list[tuple[float, float, float]]  # start, end, end + the loop's time after

    @classmethod
    def of(cls, samples: Sequence[StepSample]) -> _Busy:
        gaps = [s.gap_ms for s in samples if s.gap_ms is not None]
        after = (sum(gaps) / len(gaps) if gaps else 0.0) / 1e3
        spans = sorted(
            (s.start_s, s.start_s + s.duration_ms / 1e3, s.start_s + s.duration_ms / 1e3 + after)
            for s in samples
            if s.start_s is not None
        )
        return cls(spans)

    def _near(self, t: float) -> range:
        # Steps of one loop never overlap; of replicas they may: look back over a few.
        i = bisect.bisect_right(self.spans, (t, math.inf, math.inf))
        return range(max(0, i - 8), i)

    def busy_at(self, t: float) -> bool:
        return any(self.spans[j][2] >= t for j in self._near(t))

    def end_of_step_at(self, t: float) -> float | None:
        """The end of the step running at ``t`` (the earliest, if several)."""
        ends = [self.spans[j][1] for j in self._near(t) if self.spans[j][1] >= t]
        return min(ends) if ends else None


def overheads_of(
    records: Sequence[Record],
    server: Sequence[RequestTiming],
    samples: Sequence[StepSample] = (),
    *,
    seed: int = 0,
) -> tuple[RequestOverhead, ...]:
    """Each request the server reported and the client finished, as its measured
    (front, handoff, transport, wake) (module doc, 4).

    The handoff counts from the end of the step that produced the first token: the
    step running when the engine stamped it (its add plus its engine TTFT; the engine
    stamps a token when the forward ends, before the rest of the step). The wake is
    measured on the requests handed over while no step ran (nor the loop's mean time
    after one); the others draw one of those (seeded)."""
    busy = _Busy.of(samples)
    wakes = [
        max(0.0, w)
        for t in server
        if (w := t.add_wait_ms) is not None and not busy.busy_at(t.queued_s)
    ]
    by_id = {t.client_id: t for t in server}
    rng = random.Random(f"fit-wake:{seed}")
    out = []
    for r in records:
        t = by_id.get(r.id)
        ttft = r.ttft_ms
        if t is None or not r.ok or ttft is None:
            continue
        handoff = t.handoff_ms
        if t.added_s is not None:
            stamped = t.added_s + t.engine_ttft_ms / 1e3
            end = busy.end_of_step_at(stamped)
            if end is not None:
                handoff = (t.first_output_s - end) * 1e3
        wake = wakes[rng.randrange(len(wakes))] if wakes else 0.0
        out.append(
            RequestOverhead(
                max(0.0, t.front_ms),
                max(0.0, handoff),
                max(0.0, ttft - t.server_ttft_ms),
                wake,
                _deliveries(t, max(0.0, handoff)),
            )
        )
    return tuple(out)


def _deliveries(t: RequestTiming, handoff_ms: float) -> tuple[float, ...]:
    """The handler's delay of each output after the first (module doc, 5): its time less
    the later of its token's step end and the previous output's time, at least 0. The
    times line up on the first token: the engine's from its first token's step end, the
    handler's from the first output, which came ``handoff_ms`` after that step's end.
    Where the text stream held a token back (it completed no character) the i-th output
    is a later token's, and the delay spans the steps it waited."""
    e, h = t.engine_token_ms, t.handler_token_ms
    held = [handoff_ms + x for x in h]
    return tuple(max(0.0, held[i] - max(e[i], held[i - 1])) for i in range(1, min(len(e), len(h))))


# --------------------------------------------------------------------- replaying
def _config(sched: dict[str, Any]) -> SchedulerConfig:
    fields = {
        k: sched[k]
        for k in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "block_size",
            "num_blocks",
            "max_model_len",
            "enable_prefix_caching",
            "enable_chunked_prefill",
        )
        if k in sched
    }
    try:
        policy = PolicyName(sched.get("policy", PolicyName.DECODE_FIRST.value))
        return SchedulerConfig(**fields, policy=policy)
    except (TypeError, ValueError) as e:
        raise FitError(f"--fit: the server's scheduler settings are unusable: {e}") from None


def model_of(
    samples: Sequence[StepSample],
    sched: dict[str, Any],
    records: Sequence[Record],
    server: Sequence[RequestTiming],
    terms: Sequence[str] = tuple(STEP_TERMS),
) -> ServingModel:
    replicas = sched.get("replicas")
    router = sched.get("router")
    return ServingModel(
        fit_steps(samples, terms),
        overheads_of(records, server, samples),
        replicas if isinstance(replicas, int) and replicas >= 1 else 1,
        router if isinstance(router, str) else None,
    )


def replay(
    records: Sequence[Record], model: ServingModel, sched: dict[str, Any], *, seed: int = 0
) -> list[RequestMetrics]:
    """The run's requests in the simulator, as the client would see them: sent when they
    were sent, with their own token counts (prompts of distinct token ids: the bench's
    share no prefix), each with a measured overhead drawn for it (module doc)."""
    trace, shift = _replay_trace(records, model, seed)
    deliveries = model.deliveries
    delivery_rng = random.Random(f"fit-delivery:{seed}")
    cfg = _config(sched)
    step = model.step
    noise = None if step.noise is None else dataclasses.replace(step.noise, seed=seed)
    try:
        if model.replicas == 1:
            reqs = [t.to_request() for t in trace]
            result = simulate(Scheduler(cfg), reqs, step.cost, keep_steps=False, noise=noise)
            metrics = [RequestMetrics.of(r) for r in result.requests]
        else:
            policy = model.router or RoutingPolicy.PREFIX_AWARE.value
            cluster = simulate_cluster(
                Workload("fit-replay", tuple(trace)),
                model.replicas,
                cfg,
                step.cost,
                policy,
                keep_decisions=False,
                noise=noise,
            )
            metrics = list(cluster.requests)
    except InvalidArgument as e:
        raise FitError(f"--fit: the simulator refused the replay: {e}") from None
    return [
        _as_client_saw(m, shift[m.request_id], _draw(deliveries, delivery_rng, m.num_output_tokens))
        for m in metrics
    ]


def _draw(pool: Sequence[float], rng: random.Random, num_tokens: int) -> tuple[float, ...]:
    """One measured delivery per output after the first (none when nothing was measured:
    each then arrives as the first did)."""
    if not pool:
        return ()
    return tuple(pool[rng.randrange(len(pool))] for _ in range(max(0, num_tokens - 1)))


def _replay_trace(
    records: Sequence[Record], model: ServingModel, seed: int
) -> tuple[list[TraceRequest], dict[str, RequestOverhead]]:
    """The run's successful requests as a trace, each shifted by a measured overhead
    drawn for it (seeded), and the overhead each got."""
    rng = random.Random(f"fit-replay:{seed}")
    usable = [r for r in records if r.ok and r.sent_s is not None]
    trace: list[TraceRequest] = []
    shift: dict[str, RequestOverhead] = {}
    for i, r in enumerate(u for u in usable if u.prompt_tokens and u.completion_tokens):
        assert r.sent_s is not None and r.prompt_tokens and r.completion_tokens  # filtered
        o = model.overheads[rng.randrange(len(model.overheads))] if model.overheads else None
        o = o or RequestOverhead(0.0, 0.0, 0.0)
        shift[r.id] = o
        prompt = tuple(1 + (i * 7919 + k) % 30000 for k in range(r.prompt_tokens))
        trace.append(TraceRequest(r.id, r.sent_s * 1e3 + o.admit_ms, prompt, r.completion_tokens))
    if not trace:
        raise FitError("--fit: no request of the run succeeded; nothing to replay")
    return trace, shift


def _as_client_saw(
    m: RequestMetrics, o: RequestOverhead, deliveries: Sequence[float] = ()
) -> RequestMetrics:
    """Times from the client's send to the client holding each token: the handler takes
    the first its handoff after its step, each later one its own drawn delay
    (``deliveries``; the handoff when none) after the later of its step's end and the
    previous token's handling (module doc, 5); the client holds each half the transport
    after the handler."""
    handled: list[float] = []
    for i, t in enumerate(m.token_times_ms):
        delay = deliveries[i - 1] if 0 < i <= len(deliveries) else o.handoff_ms
        handled.append(max(t, handled[-1] if handled else t) + delay)
    times = [h + o.transport_ms / 2 for h in handled]
    finished = None if m.finished_ms is None else m.finished_ms + o.deliver_ms
    if finished is not None and times:
        finished = max(finished, times[-1])
    return dataclasses.replace(
        m,
        arrival_ms=m.arrival_ms - o.admit_ms,
        token_times_ms=tuple(times),
        finished_ms=finished,
    )


# --------------------------------------------------------------------- comparing
def _good(ttft: float | None, tpot: float | None, slo: Slo) -> bool:
    return ttft is not None and ttft <= slo.ttft_ms and (tpot is None or tpot <= slo.tpot_ms)


def _ttfts(rs: Sequence[Record]) -> list[float]:
    return [t for r in rs if (t := r.ttft_ms) is not None]


def _tbts(rs: Sequence[Record]) -> list[float]:
    return [g for r in rs for g in r.tbt_ms]


def compare(
    records: Sequence[Record],
    simulated: Sequence[RequestMetrics],
    slo: Slo = DEFAULT_SLO,
    duration_s: float | None = None,
    replays: int = 1,
) -> tuple[Comparison, ...]:
    """TTFT and TBT P50/P90/P99, and goodput (requests/s within ``slo`` over the run's
    ``duration_s``, both sides over the same span) when the duration is given.
    ``simulated`` may pool ``replays`` replays of the run (goodput per replay)."""
    ok = [r for r in records if r.ok]
    sim_ttft = [t for m in simulated if (t := m.ttft_ms) is not None]
    sim_tbt = [g for m in simulated for g in m.itl_ms]
    rng = random.Random("fit-interval")
    # Resampled by request (a request's token gaps together): which requests were slow.
    draws = [[ok[rng.randrange(len(ok))] for _ in ok] for _ in range(INTERVAL_ROUNDS)] if ok else []
    out = []
    for name, of, sim in (("TTFT", _ttfts, sim_ttft), ("TBT", _tbts, sim_tbt)):
        for q in (50, 90, 99):
            lo, hi = _interval([percentile(of(d), q) for d in draws])
            out.append(
                Comparison(f"{name} P{q}", percentile(of(ok), q), percentile(sim, q), "ms", lo, hi)
            )
    if duration_s is not None and duration_s > 0:
        out.append(_goodput(ok, simulated, draws, slo, duration_s, replays))
    return tuple(out)


def _goodput(
    ok: Sequence[Record],
    simulated: Sequence[RequestMetrics],
    draws: Sequence[Sequence[Record]],
    slo: Slo,
    duration_s: float,
    replays: int,
) -> Comparison:
    """Requests per second within ``slo``, measured (with its interval over ``draws``)
    and simulated (per replay)."""

    def goodput(rs: Sequence[Record]) -> float:
        return sum(_good(r.ttft_ms, r.tpot_ms, slo) for r in rs) / duration_s

    sim_count = sum(_good(m.ttft_ms, m.tpot_ms, slo) for m in simulated)
    sim_good = sim_count / (duration_s * max(1, replays))
    lo, hi = _interval([goodput(d) for d in draws])
    return Comparison("goodput", goodput(ok), sim_good, "req/s", lo, hi)


def _interval(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    xs = [v for v in values if v is not None]
    return (percentile(xs, 5), percentile(xs, 95)) if xs else (None, None)


def fit_and_replay(
    client: httpx.Client,
    start: FitStart,
    records: Sequence[Record],
    *,
    slo: Slo = DEFAULT_SLO,
    duration_s: float | None = None,
) -> FitResult:
    samples, sched = read_steps(client, start.step)
    server = read_requests(client, start.request)
    model = model_of(samples, sched, records, server)
    simulated = replay_pooled(records, model, sched, REPLAYS)
    return FitResult(model, compare(records, simulated, slo, duration_s, REPLAYS))


def replay_pooled(
    records: Sequence[Record], model: ServingModel, sched: dict[str, Any], replays: int
) -> list[RequestMetrics]:
    """``replays`` replays of the run (seeds 0, 1, ...), their requests pooled: the
    model's prediction is a distribution, and one replay's P90 of a few hundred requests
    under a long-tailed scatter is one draw of it."""
    return [m for seed in range(replays) for m in replay(records, model, sched, seed=seed)]


# --------------------------------------------------------------------- reporting
def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or math.isnan(x) else format(x, fmt)


def render(fit: FitResult) -> str:
    m = fit.model
    step = m.step
    shape = f"{m.replicas} replica" + ("s" if m.replicas > 1 else "")
    shape += f" behind the {m.router} router" if m.router else ""
    lines = [
        f"fitted over {step.num_steps} server steps ({shape}): {step.cost} ms "
        f"(step fit R1 {step.r_squared:.3f})",
        "",
        "| term | charges | ms | std err | R1 lost without it |",
        "|---|---|---:|---:|---:|",
    ]
    for t in step.terms:
        lines.append(
            f"| {t.name} | {t.meaning} | {t.value_ms:.4f} | {_num(t.stderr_ms, '.4f')} "
            f"| {_num(t.r2_drop, '.3f')} |"
        )
    if step.noise is not None:
        lines.append("")
        pools = (("every step", step.noise.factors), ("with prefill", step.noise.prefill_factors))
        for name, f in pools:
            if f:
                lines.append(
                    f"step scatter, {name} (measured over modelled): "
                    + ", ".join(f"P{q} {percentile(f, q):.2f}" for q in (10, 50, 90, 99))
                    + f", mean {sum(f) / len(f):.2f}"
                )
    lines += ["", "| per request | what | P50 ms | P90 ms | requests |", "|---|---|---:|---:|---:|"]
    for o in m.overhead_terms:
        lines.append(
            f"| {o.name} | {o.meaning} | {_num(o.p50_ms, '.2f')} | {_num(o.p90_ms, '.2f')} "
            f"| {o.num_requests} |"
        )
    if not m.overheads:
        lines += ["", "no per-request records (GET /debug/requests): overheads not modelled"]
    lines += ["", *comparison_table(fit.comparisons)]
    return "\n".join(lines)


def comparison_table(comparisons: Sequence[Comparison]) -> list[str]:
    """The simulator's error per figure, with the measured figure's own interval."""
    lines = [
        "| metric | measured | measured, 90 % interval | simulated | simulator error |",
        "|---|---:|---:|---:|---:|",
    ]
    for cmp in comparisons:
        err = "-" if cmp.error is None or math.isnan(cmp.error) else f"{cmp.error:+.0%}"
        fmt = ".1f" if cmp.unit == "ms" else ".2f"
        meas, sim = _num(cmp.measured, fmt), _num(cmp.simulated, fmt)
        span = f"{_num(cmp.measured_lo, fmt)} - {_num(cmp.measured_hi, fmt)}"
        lines.append(f"| {cmp.metric} ({cmp.unit}) | {meas} | {span} | {sim} | {err} |")
    return lines


def fit_json(fit: FitResult) -> dict[str, Any]:
    """The fit as the bench's JSON records it (``runs[i].fit``)."""
    m = fit.model
    return {
        "cost_ms": dataclasses.asdict(fit.cost),
        "num_steps": fit.num_steps,
        "r_squared": fit.r_squared,
        "replicas": m.replicas,
        "router": m.router,
        "terms": [dataclasses.asdict(t) for t in m.step.terms],
        "noise_factors": None if m.step.noise is None else list(m.step.noise.factors),
        "overheads": [dataclasses.asdict(o) for o in m.overhead_terms],
        "comparisons": [{**dataclasses.asdict(c), "error": c.error} for c in fit.comparisons],
    }
