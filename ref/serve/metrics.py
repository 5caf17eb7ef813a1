"""``GET /metrics``: Prometheus metrics under vLLM's names where vLLM has one.

One :class:`ServerMetrics` per app, each with its own registry (several servers in one
process, as in the tests, must not share counters). The engine thread updates it after
each step; prometheus-client's metrics are thread-safe. Names without a vLLM
counterpart (swap traffic, the loop's step gap) are under ``refserve:``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from ref.engine.llm_engine import LLMEngine, RequestOutput

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch.", labels, registry=r
        )
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be admitted.", labels, registry=r
        )
        self._kv = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", labels, registry=r
        )
        self._preempt = Counter(
            "vllm:num_preemptions", "Preemptions of running requests.", labels, registry=r
        )
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels,
            registry=r,
        )  # fmt: skip
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r
        )
        self._gen_tokens = Counter(
            "vllm:generation_tokens", "Output tokens generated.", labels, registry=r
        )
        self._success = Counter(
            "vllm:request_success", "Finished requests, by finish reason.",
            [*labels, "finished_reason"], registry=r,
        )  # fmt: skip
        self._swap_out = Counter(
            "refserve:swapped_out_bytes", "KV bytes copied device to host.", labels, registry=r
        )
        self._swap_in = Counter(
            "refserve:swapped_in_bytes", "KV bytes copied host to device.", labels, registry=r
        )
        # Speculative decoding (docs/SPECULATIVE.md); the acceptance rate is
        # accepted / draft tokens.
        self._spec_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Verifications (a request's step with drafts).",
            labels, registry=r,
        )  # fmt: skip
        self._spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", labels, registry=r
        )
        self._spec_accepted = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels, registry=r
        )
        self._name = model_name
        # Engine totals already exported (the engine counts cumulatively).
        self._seen = dict.fromkeys(
            ("preempt", "prefix", "out", "in", "drafts", "draft_tokens", "accepted"), 0
        )

    def after_step(self, engine: LLMEngine, outputs: Sequence[RequestOutput]) -> None:
        """Called on the engine thread after each step."""
        m = self._name
        sched = engine.scheduler
        self._running.labels(m).set(len(sched.running))
        self._waiting.labels(m).set(len(sched.requests) - len(sched.running))
        pool = sched.pool
        self._kv.labels(m).set(pool.num_used_blocks / max(1, sched.config.num_blocks))
        self._bump("preempt", engine.num_preemptions, self._preempt)
        self._bump("prefix", engine.num_prefix_hit_tokens, self._prefix_hits)
        self._bump("out", engine.swap_out_bytes, self._swap_out)
        self._bump("in", engine.swap_in_bytes, self._swap_in)
        self._bump("drafts", engine.num_verifications, self._spec_drafts)
        self._bump("draft_tokens", engine.num_draft_tokens, self._spec_draft_tokens)
        self._bump("accepted", engine.num_accepted_tokens, self._spec_accepted)
        for o in outputs:
            self._gen_tokens.labels(m).inc(len(o.new_token_ids))
            if o.finished:
                self._finished(o)

    def _bump(self, key: str, total: int, counter: Counter) -> None:
        delta = total - self._seen[key]
        if delta > 0:
            counter.labels(self._name).inc(delta)
        self._seen[key] = total

    def _finished(self, o: RequestOutput) -> None:
        m, mt = self._name, o.metrics
        self._success.labels(m, o.finish_reason or "unknown").inc()
        if o.index == 0:
            self._prompt_tokens.labels(m).inc(mt.num_prompt_tokens)
        if mt.ttft_ms is not None:
            self._ttft.labels(m).observe(mt.ttft_ms / 1e3)
        for gap in mt.itl_ms:
            self._itl.labels(m).observe(gap / 1e3)
        if mt.e2e_ms is not None:
            self._e2e.labels(m).observe(mt.e2e_ms / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)
