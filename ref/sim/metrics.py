"""Run-level throughput and latency figures over per-request records (docs/ARCHITECTURE.md,
example 2f; the per-request record, ``RequestMetrics``, is ref/core/request_metrics.py).

Per request: queueing delay (admitted - arrival), TTFT (first token - arrival), ITL (gaps
between consecutive tokens), TPOT (mean ITL), E2E (last token - arrival). Per run: input
tokens/s, output tokens/s and requests/s kept apart, percentiles of TTFT and ITL, and the
time-averaged number of requests in the system, which with throughput and mean E2E obeys
Little's law L = lambda * W over the whole run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from refserve.core.request_metrics import RequestMetrics


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def littles_law_l(arrival_rate_per_s: float, mean_time_in_system_s: float) -> float:
    """L = lambda * W (example 2g: 16 req/s * 0.75 s = 12 requests in the system)."""
    return arrival_rate_per_s * mean_time_in_system_s


@dataclass(frozen=True)
class RunMetrics:
    num_requests: int
    num_finished: int
    duration_ms: float
    input_tokens: int
    output_tokens: int
    input_tokens_per_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    mean_e2e_ms: float | None
    mean_in_system: float  # time-averaged L over [first arrival, last finish]
    num_preemptions: int
    num_cached_tokens: int

    @classmethod
    def of(cls, requests: Sequence[RequestMetrics], duration_ms: float) -> RunMetrics:
        secs = duration_ms / 1e3 if duration_ms > 0 else math.inf
        # A request is done when it has an end-to-end time (its last token).
        e2es = [e for r in requests if (e := r.e2e_ms) is not None]
        ttfts = [t for r in requests if (t := r.ttft_ms) is not None]
        itls = [x for r in requests for x in r.itl_ms]
        # Each request is in the system from arrival to its last token: the integral of
        # N(t) over the run is the sum of E2E, so L = sum(E2E) / duration exactly.
        in_system = sum(e2es) / duration_ms if duration_ms > 0 else 0.0
        out_tokens = sum(r.num_output_tokens for r in requests)
        in_tokens = sum(r.num_prompt_tokens for r in requests)
        return cls(
            num_requests=len(requests),
            num_finished=len(e2es),
            duration_ms=duration_ms,
            input_tokens=in_tokens,
            output_tokens=out_tokens,
            input_tokens_per_s=in_tokens / secs,
            output_tokens_per_s=out_tokens / secs,
            requests_per_s=len(e2es) / secs,
            ttft_ms=_percentiles(ttfts),
            itl_ms=_percentiles(itls),
            mean_e2e_ms=_mean(e2es),
            mean_in_system=in_system,
            num_preemptions=sum(r.num_preemptions for r in requests),
            num_cached_tokens=sum(r.num_cached_tokens for r in requests),
        )


def _mean(xs: Sequence[float]) -> float | None:
    return (sum(xs) / len(xs)) if xs else None


def _percentiles(xs: list[float]) -> dict[str, float | None]:
    """P50, P95, P99 and the mean (None each for no values)."""
    return {
        "p50": percentile(xs, 50),
        "p95": percentile(xs, 95),
        "p99": percentile(xs, 99),
        "mean": _mean(xs),
    }


@dataclass(frozen=True)
class TenantMetrics:
    """Fairness report for one tenant (per-tenant TTFT/TBT and service)."""

    tenant: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p99_ms: float | None


def per_tenant(requests: Sequence[RequestMetrics]) -> dict[str, TenantMetrics]:
    out: dict[str, TenantMetrics] = {}
    for tenant in sorted({r.tenant for r in requests}):
        mine = [r for r in requests if r.tenant == tenant]
        ttfts = [t for r in mine if (t := r.ttft_ms) is not None]
        itls = [x for r in mine for x in r.itl_ms]
        out[tenant] = TenantMetrics(
            tenant,
            len(mine),
            sum(r.num_prompt_tokens for r in mine),
            sum(r.num_output_tokens for r in mine),
            percentile(ttfts, 50),
            percentile(ttfts, 99),
            percentile(itls, 99),
        )
    return out


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` of non-negative shares.

    1.0 when every share is equal, ``1/n`` when one party gets everything; None for no
    values. All-zero shares are equal shares (nobody was served), so 1.0.
    """
    if not values:
        return None
    if any(v < 0 for v in values):
        raise ValueError(f"shares must be >= 0, got {min(values)}")
    square_sum = sum(v * v for v in values)
    if square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)
