"""The soak (conformance/bench/soak.py), short: two in-process replicas under open-loop load with
kills, disconnects, aborts and bad requests pass its four promises; a planted leak (a
block table left behind when a client leaves) and a planted double end (a stream that
finishes twice) each fail it, named. ``make soak`` is the 10-minute run."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from serve_helpers import MODEL, TIMEOUT_S, cluster_config, start

from refserve.cluster import InProcessReplica, Router
from refserve.conformance.bench import soak
from refserve.engine.llm_engine import LLMEngine
from refserve.errors import InvalidArgument
from refserve.serve.app import ASGIApp, Message, Receive, Scope, Send, ServeSettings
from refserve.serve.cluster_loop import ClusterLoop
from refserve.serve.metrics import ClusterServeMetrics
from refserve.serve.server import ServerThread, build_cluster_server

#: The clean run: about 20 s of load, a kill every 6 s on average (seeded: three kills).
CLEAN = soak.SoakSettings(
    duration_s=20.0, rate_rps=3.0, seed=1, kill_every_s=6.0, max_tokens=(8, 64),
    request_timeout_s=TIMEOUT_S, settle_s=15.0, rss_every_s=1.0,
)  # fmt: skip
#: The planted faults' runs: shorter, and no kill (a kill would take the leak with it).
SHORT = soak.SoakSettings(
    duration_s=8.0, rate_rps=3.0, seed=2, kill_every_s=0.0, max_tokens=(8, 64),
    request_timeout_s=TIMEOUT_S, settle_s=10.0, rss_every_s=1.0,
)  # fmt: skip


class LeakyReplica(InProcessReplica):
    """A planted leak: when a client leaves, a block table is left behind in the pool
    under a name no request owns (the blocks are never freed)."""

    def abort(self, request_id: str) -> None:
        pool = self.engine.scheduler.pool
        pool.allocate(f"{request_id}-left-behind", [1] * 16, 16)
        super().abort(request_id)


def _serve(
    replica: Callable[[LLMEngine], InProcessReplica] = InProcessReplica,
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
    fault_endpoints: bool = True,
) -> ServerThread:
    """Two replicas behind the router as ``refserve serve --replicas 2 --fault-endpoints``
    builds them (a dead one restarted), on a free loopback port."""

    def make(slot: int = 0) -> InProcessReplica:
        return replica(LLMEngine(MODEL, scheduler_config=cluster_config()))

    first = make()
    loop = ClusterLoop(
        [first, make()],
        Router("prefix_aware"),
        tokenizer=first.engine.tokenizer,
        max_model_len=first.engine.max_model_len,
        scheduler_config=cluster_config(),
        metrics=ClusterServeMetrics(soak.MODEL),
        restart=make,
        max_restarts=100,
    )
    settings = ServeSettings(soak.MODEL, drain_timeout_s=5.0, fault_endpoints=fault_endpoints)
    server = build_cluster_server(loop, settings)
    if wrap is not None:
        server.uvicorn.config.app = wrap(server.uvicorn.config.app)
    return ServerThread(server).start()


def _run(handle: ServerThread, settings: soak.SoakSettings) -> soak.Soak:
    try:
        return asyncio.run(soak.run_soak(handle.base_url, settings))
    finally:
        handle.stop()


def test_the_cluster_keeps_its_promises_under_faults() -> None:
    result = _run(_serve(), CLEAN)
    figures = soak.summary(result)
    assert result.failures == [], result.failures
    ends = figures["ends"]
    # Every kind of fault happened, and every request ended once, typed.
    assert ends["broken"] == 0 and ends["left"] > 0 and ends["refused"] > 0, ends
    assert sum(ends.values()) == figures["requests"] == len(soak.plan(CLEAN).requests)
    assert result.kills_sent == len(soak.plan(CLEAN).kills) >= 2
    assert figures["server"]["replica_restarts_total"] == result.kills_sent
    assert all(x["report"]["free_blocks"] == x["report"]["num_blocks"]
               for x in result.final_pools)  # fmt: skip
    assert figures["goodput_rps"] > 0 and result.rss


def test_a_planted_leak_fails_the_soak() -> None:
    assert any(q.kind in (soak.Kind.ABORT, soak.Kind.DISCONNECT) for q in soak.plan(SHORT).requests)
    result = _run(_serve(LeakyReplica), SHORT)
    pools = [f for f in result.failures if f.startswith("pools:")]
    assert any("[LEAK]" in f and "left-behind" in f for f in pools), result.failures
    assert any("blocks held at the end" in f for f in pools), result.failures


def _finishing_twice(app: ASGIApp) -> ASGIApp:
    """A planted double end: the first streamed event that carries a finish reason is
    sent twice (a stream's only: a plain answer's length is declared)."""
    planted = [False]
    reason = re.compile(rb'"finish_reason":"[a-z]+"')

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        streamed = [False]

        async def twice(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                streamed[0] = b"text/event-stream" in dict(message["headers"]).get(
                    b"content-type", b""
                )
            body = message.get("body", b"")
            if streamed[0] and not planted[0] and reason.search(body):
                planted[0] = True
                await send(message)

        await app(scope, receive, twice)

    return wrapped


def test_a_planted_double_end_fails_the_soak() -> None:
    result = _run(_serve(wrap=_finishing_twice), SHORT)
    ends = [f for f in result.failures if f.startswith("ends:")]
    assert len(ends) == 1 and "finished twice" in ends[0], result.failures


def test_the_kill_endpoint_is_opt_in_and_checks_its_replica() -> None:
    handle = _serve(fault_endpoints=False)
    try:
        r = httpx.post(f"{handle.base_url}/debug/replicas/0/kill", timeout=TIMEOUT_S)
        assert r.status_code in (404, 405) and r.json()["error"]["type"]
        pools = httpx.get(f"{handle.base_url}/debug/pools", timeout=TIMEOUT_S).json()
        assert [x["replica"] for x in pools["replicas"]] == [0, 1]
        assert all(x["report"]["violations"] == [] for x in pools["replicas"])
    finally:
        handle.stop()
    handle = _serve()
    try:
        r = httpx.post(f"{handle.base_url}/debug/replicas/2/kill", timeout=TIMEOUT_S)
        assert r.status_code == 404 and "no replica 2" in r.json()["error"]["message"]
    finally:
        handle.stop()


def test_one_engine_answers_its_pools_too() -> None:
    handle = start()
    try:
        r = httpx.get(f"{handle.base_url}/debug/pools", timeout=TIMEOUT_S)
        (slot,) = r.json()["replicas"]
        report = slot["report"]
        assert report["violations"] == [] and report["free_blocks"] == report["num_blocks"]
        assert report["rss_bytes"] > 0 and report["live_requests"] == []
    finally:
        handle.stop()


def test_the_plan_is_drawn_from_its_seed_and_settings_are_checked() -> None:
    assert soak.plan(CLEAN) == soak.plan(CLEAN)
    assert soak.plan(CLEAN) != soak.plan(SHORT)
    bad: list[dict[str, Any]] = [{"duration_s": 0}, {"rate_rps": -1.0},
                                 {"error_budget": 2.0}, {"replicas": 0}]  # fmt: skip
    for kw in bad:
        with pytest.raises(InvalidArgument, match="soak"):
            soak.SoakSettings(**kw)
