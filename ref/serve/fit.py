"""``refserve bench-serve --fit``: calibrate the simulator from a live server, then check it.

1. The server's own per-step records (``GET /debug/steps?since=K``, :mod:`refserve.serve.loop`:
   the step's wall time, its prefill tokens ``P`` and decodes ``D``) over the run are fitted
   to the simulator's iteration model ``a + b*P + c*D`` ms by least squares (a coefficient
   that comes out negative is fixed at 0 and the others refitted: the model's cost terms
   cannot be negative).
2. The same requests (their send times, and their token counts from ``usage``) are replayed
   in the simulator with that cost and the server's scheduler settings.
3. The simulator's TTFT and TBT percentiles are compared with the measured ones.

What the simulator does not model shows up as its error: the HTTP and streaming time
around each request, the gaps between steps (the loop's hand-offs), and a step time that
is not linear in ``P`` and ``D`` (attention over long contexts; use a richer cost then).
The fit needs refserve's debug endpoint; another server gives a clear error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from refserve.core.config import PolicyName, SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.errors import InvalidArgument, RefserveError
from refserve.serve.bench import Record
from refserve.sim.metrics import RequestMetrics, percentile
from refserve.sim.simulator import simulate


class FitError(RefserveError):
    """The server's step records could not be read or fitted."""


@dataclass(frozen=True)
class StepSample:
    duration_ms: float
    num_prefill_tokens: int
    num_decodes: int


@dataclass(frozen=True)
class Comparison:
    metric: str
    measured_ms: float | None
    simulated_ms: float | None

    @property
    def error(self) -> float | None:
        if self.measured_ms is None or self.simulated_ms is None or self.measured_ms == 0:
            return None
        return (self.simulated_ms - self.measured_ms) / self.measured_ms


@dataclass(frozen=True)
class FitResult:
    cost: StepCost
    num_steps: int
    r_squared: float
    comparisons: tuple[Comparison, ...]


def last_step_index(client: httpx.Client) -> int:
    doc = _debug(client, "/debug/steps?last=1")
    steps = doc.get("steps")
    if not isinstance(steps, list) or not steps:
        return -1
    index = steps[-1].get("index") if isinstance(steps[-1], dict) else None
    return index if isinstance(index, int) else -1


def _debug(client: httpx.Client, path: str) -> dict[str, Any]:
    try:
        r = client.get(path)
    except httpx.HTTPError as e:
        raise FitError(f"--fit: GET {path}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
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
    doc = _debug(client, f"/debug/steps?since={since}")
    samples: list[StepSample] = []
    for s in doc.get("steps") or []:
        try:
            samples.append(
                StepSample(
                    float(s["duration_ms"]), int(s["num_prefill_tokens"]), int(s["num_decodes"])
                )
            )
        except (KeyError, TypeError, ValueError):
            raise FitError(f"--fit: a step record is malformed: {str(s)[:200]}") from None
    sched = doc.get("scheduler")
    return samples, sched if isinstance(sched, dict) else {}


def fit_cost(samples: Sequence[StepSample]) -> tuple[StepCost, float]:
    """Least squares ``duration = a + b*P + c*D`` with ``a, b, c >= 0``; and its R^2."""
    if len(samples) < 3:
        raise FitError(f"--fit: {len(samples)} step records; at least 3 are needed")
    x = torch.tensor(
        [[1.0, s.num_prefill_tokens, s.num_decodes] for s in samples], dtype=torch.float64
    )
    y = torch.tensor([s.duration_ms for s in samples], dtype=torch.float64)
    keep = [0, 1, 2]
    coef = torch.zeros(3, dtype=torch.float64)
    for _ in range(3):  # drop a negative term and refit the rest (at most 3 passes)
        sol = torch.linalg.lstsq(x[:, keep], y.unsqueeze(1)).solution.squeeze(1)
        coef = torch.zeros(3, dtype=torch.float64)
        coef[keep] = sol
        negative = [k for k in keep if coef[k] < 0]
        if not negative:
            break
        keep = [k for k in keep if k not in negative]
        coef[negative] = 0.0
        if not keep:
            break
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    a, b, c = (max(0.0, float(v)) for v in coef)
    return StepCost(a=a, b=b, c=c), r2


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


def replay(
    records: Sequence[Record], cost: StepCost, sched: dict[str, Any]
) -> list[RequestMetrics]:
    """The run's requests in the simulator: sent when they were sent, with their own
    token counts; prompts of distinct token ids (the bench's prompts share no prefix)."""
    reqs = []
    usable = [r for r in records if r.ok and r.sent_s is not None]
    for i, r in enumerate(u for u in usable if u.prompt_tokens and u.completion_tokens):
        assert r.sent_s is not None and r.prompt_tokens and r.completion_tokens  # filtered
        prompt = [1 + (i * 7919 + k) % 30000 for k in range(r.prompt_tokens)]
        reqs.append(
            Request(
                r.id,
                prompt,
                StopParams(max_tokens=r.completion_tokens, ignore_eos=True),
                arrival_ms=r.sent_s * 1e3,
            )
        )
    if not reqs:
        raise FitError("--fit: no request of the run succeeded; nothing to replay")
    try:
        result = simulate(Scheduler(_config(sched)), reqs, cost, keep_steps=False)
    except InvalidArgument as e:
        raise FitError(f"--fit: the simulator refused the replay: {e}") from None
    return [RequestMetrics.of(r) for r in result.requests]


def compare(
    records: Sequence[Record], simulated: Sequence[RequestMetrics]
) -> tuple[Comparison, ...]:
    ok = [r for r in records if r.ok]
    ttft = [t for r in ok if (t := r.ttft_ms) is not None]
    tbt = [g for r in ok for g in r.tbt_ms]
    sim_ttft = [t for m in simulated if (t := m.ttft_ms) is not None]
    sim_tbt = [g for m in simulated for g in m.itl_ms]
    out = []
    for name, meas, sim in (("TTFT", ttft, sim_ttft), ("TBT", tbt, sim_tbt)):
        for q in (50, 90, 99):
            out.append(Comparison(f"{name} P{q}", percentile(meas, q), percentile(sim, q)))
    return tuple(out)


def fit_and_replay(client: httpx.Client, since: int, records: Sequence[Record]) -> FitResult:
    samples, sched = read_steps(client, since)
    cost, r2 = fit_cost(samples)
    return FitResult(cost, len(samples), r2, compare(records, replay(records, cost, sched)))


def render(fit: FitResult) -> str:
    c = fit.cost
    lines = [
        f"fitted iteration cost over {fit.num_steps} server steps: "
        f"{c.a:.3f} + {c.b:.4f}*P + {c.c:.4f}*D ms (R^2 {fit.r_squared:.3f})",
        "",
        "| metric | measured ms | simulated ms | simulator error |",
        "|---|---:|---:|---:|",
    ]
    for cmp in fit.comparisons:
        err = "-" if cmp.error is None or math.isnan(cmp.error) else f"{cmp.error:+.0%}"
        m = "-" if cmp.measured_ms is None else f"{cmp.measured_ms:.1f}"
        s = "-" if cmp.simulated_ms is None else f"{cmp.simulated_ms:.1f}"
        lines.append(f"| {cmp.metric} | {m} | {s} | {err} |")
    return "\n".join(lines)
