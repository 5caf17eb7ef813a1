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
    from refserve.engine.llm_engine import LLMEngine, RequestOutput

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class RequestFigures:
    """What a server and a cluster server both export: latencies, load and token counts,
    under vLLM's names, labelled by ``labels`` (the model name, and the replica in a
    cluster). Each method takes the label values of the series to update."""

    def __init__(self, registry: CollectorRegistry, labels: list[str]) -> None:
        r = registry
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch.", labels, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be admitted.", labels, registry=r
        )
        self.kv = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", labels, registry=r
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r
        )
        self.gen_tokens = Counter(
            "vllm:generation_tokens", "Output tokens generated.", labels, registry=r
        )
        self.success = Counter(
            "vllm:request_success", "Finished requests, by finish reason.",
            [*labels, "finished_reason"], registry=r,
        )  # fmt: skip

    def load(self, values: tuple[str, ...], running: int, waiting: int, kv_usage: float) -> None:
        self.running.labels(*values).set(running)
        self.waiting.labels(*values).set(waiting)
        self.kv.labels(*values).set(kv_usage)

    def outputs(self, values: tuple[str, ...], outputs: Sequence[RequestOutput]) -> None:
        """A step's outputs: the tokens they carry, and the figures of those finished."""
        for o in outputs:
            self.gen_tokens.labels(*values).inc(len(o.new_token_ids))
            if not o.finished:
                continue
            mt = o.metrics
            self.success.labels(*values, o.finish_reason or "unknown").inc()
            if o.index == 0:
                self.prompt_tokens.labels(*values).inc(mt.num_prompt_tokens)
            if mt.ttft_ms is not None:
                self.ttft.labels(*values).observe(mt.ttft_ms / 1e3)
            for gap in mt.itl_ms:
                self.itl.labels(*values).observe(gap / 1e3)
            if mt.e2e_ms is not None:
                self.e2e.labels(*values).observe(mt.e2e_ms / 1e3)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self._requests = RequestFigures(r, labels)
        self._preempt = Counter(
            "vllm:num_preemptions", "Preemptions of running requests.", labels, registry=r
        )
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels,
            registry=r,
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
        running = len(sched.running)
        kv_usage = sched.pool.num_used_blocks / max(1, sched.config.num_blocks)
        self._requests.load((m,), running, len(sched.requests) - running, kv_usage)
        self._bump("preempt", engine.num_preemptions, self._preempt)
        self._bump("prefix", engine.num_prefix_hit_tokens, self._prefix_hits)
        self._bump("out", engine.swap_out_bytes, self._swap_out)
        self._bump("in", engine.swap_in_bytes, self._swap_in)
        self._bump("drafts", engine.num_verifications, self._spec_drafts)
        self._bump("draft_tokens", engine.num_draft_tokens, self._spec_draft_tokens)
        self._bump("accepted", engine.num_accepted_tokens, self._spec_accepted)
        self._requests.outputs((m,), outputs)

    def _bump(self, key: str, total: int, counter: Counter) -> None:
        delta = total - self._seen[key]
        if delta > 0:
            counter.labels(self._name).inc(delta)
        self._seen[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ClusterServeMetrics:
    """``/metrics`` of a cluster server (docs/CLUSTER.md, "Serving"): the per-request and
    load figures of :class:`ServerMetrics` under the same names with a ``replica`` label,
    and the router's: routing decisions by policy and replica, prompt and prefix-hit
    tokens at routing, migrations by outcome, K/V bytes and seconds migrating, replicas
    up, their deaths and restarts, and a dead replica's requests: ended with its error,
    or added again on a live one; with roles (docs/DISAGG.md), handoffs, handoffs kept
    and deflections. The replica threads and the router update it;
    prometheus-client's metrics are thread-safe. Not here (they need the engine object,
    which a Ray replica does not hand over): preemption, prefix-cache, swap and
    speculation counters."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name", "replica"]
        self._requests = RequestFigures(r, labels)
        self._up = Gauge("refserve:replica_up", "1 while the replica is alive.", labels, registry=r)
        self._failed = Counter(
            "refserve:replica_failed_requests", "Requests ended because their replica died.",
            labels, registry=r,
        )  # fmt: skip
        self._deaths = Counter(
            "refserve:replica_deaths", "Times the replica died (its actor or process gone).",
            labels, registry=r,
        )  # fmt: skip
        self._restarts = Counter(
            "refserve:replica_restarts", "Times a fresh replica took the dead one's place.",
            labels, registry=r,
        )  # fmt: skip
        self._restarted = Counter(
            "refserve:replica_restarted_requests",
            "Requests of the replica that died before delivering anything, added again on "
            "a live one.", labels, registry=r,
        )  # fmt: skip
        self._decisions = Counter(
            "refserve:router_decisions", "Requests routed, by policy and replica.",
            ["model_name", "policy", "replica"], registry=r,
        )  # fmt: skip
        self._routed_tokens = Counter(
            "refserve:router_prompt_tokens", "Prompt tokens routed.", labels, registry=r
        )
        self._routed_hits = Counter(
            "refserve:router_prefix_hit_tokens",
            "Prompt tokens cached on the chosen replica at routing (the global index).",
            labels, registry=r,
        )  # fmt: skip
        self._migrations = Counter(
            "refserve:migrations", "Migrations between replicas, by outcome (done, aborted).",
            ["model_name", "outcome"], registry=r,
        )  # fmt: skip
        self._migration_bytes = Counter(
            "refserve:migration_bytes", "K/V bytes moved between replicas.", ["model_name"],
            registry=r,
        )  # fmt: skip
        self._migration_s = Counter(
            "refserve:migration_seconds", "Time spent migrating.", ["model_name"], registry=r
        )
        self._handoffs = Counter(
            "refserve:handoffs",
            "Requests handed off after their first token from a prefill replica to this "
            "decode replica (docs/DISAGG.md).", labels, registry=r,
        )  # fmt: skip
        self._handoff_bytes = Counter(
            "refserve:handoff_bytes", "K/V bytes moved by handoffs.", ["model_name"], registry=r
        )
        self._handoffs_kept = Counter(
            "refserve:handoffs_kept",
            "Handoffs that did not happen, the request decoding on its prefill replica, by "
            "reason (no_decode: no decode replica with a seat and the blocks; failed: "
            "refused, aborted, or the decode replica dead or late).",
            ["model_name", "reason"], registry=r,
        )  # fmt: skip
        self._deflections = Counter(
            "refserve:deflections",
            "New requests prefilled on this decode replica instead of a prefill replica "
            "(the prefill side's predicted TTFT missed the SLO).", labels, registry=r,
        )  # fmt: skip
        self._name = model_name

    def handed_off(self, replica: int, kv_bytes: int) -> None:
        """A request handed off to decode replica ``replica``."""
        self._handoffs.labels(self._name, str(replica)).inc()
        self._handoff_bytes.labels(self._name).inc(kv_bytes)

    def handoff_kept(self, reason: str) -> None:
        self._handoffs_kept.labels(self._name, reason).inc()

    def deflected(self, replica: int) -> None:
        """A new request's prefill deflected to decode replica ``replica``."""
        self._deflections.labels(self._name, str(replica)).inc()

    def replica_up(self, replica: int, up: bool) -> None:
        self._up.labels(self._name, str(replica)).set(1 if up else 0)

    def replica_died(self, replica: int) -> None:
        self.replica_up(replica, False)
        self._deaths.labels(self._name, str(replica)).inc()

    def replica_restarted(self, replica: int) -> None:
        self._restarts.labels(self._name, str(replica)).inc()
        self.replica_up(replica, True)

    def requests_failed(self, replica: int, num_requests: int) -> None:
        """Requests ended with the error of ``replica``'s death."""
        self._failed.labels(self._name, str(replica)).inc(num_requests)

    def request_restarted(self, replica: int) -> None:
        """A request of ``replica``, dead, added again on a live one."""
        self._restarted.labels(self._name, str(replica)).inc()

    def routed(self, policy: str, replica: int, prompt_tokens: int, hit_tokens: int) -> None:
        m, rep = self._name, str(replica)
        self._decisions.labels(m, policy, rep).inc()
        self._routed_tokens.labels(m, rep).inc(prompt_tokens)
        self._routed_hits.labels(m, rep).inc(hit_tokens)

    def migrated(self, done: bool, kv_bytes: int = 0, seconds: float = 0.0) -> None:
        m = self._name
        self._migrations.labels(m, "done" if done else "aborted").inc()
        if done:
            self._migration_bytes.labels(m).inc(kv_bytes)
            self._migration_s.labels(m).inc(seconds)

    def after_step(
        self,
        replica: int,
        running: int,
        waiting: int,
        kv_usage: float,
        outputs: Sequence[RequestOutput],
    ) -> None:
        """Called on replica ``replica``'s thread after each of its steps."""
        values = (self._name, str(replica))
        self._requests.load(values, running, waiting, kv_usage)
        self._requests.outputs(values, outputs)

    def render(self) -> bytes:
        return generate_latest(self.registry)
