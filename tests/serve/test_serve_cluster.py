"""``refserve serve --replicas 2`` in process: the same OpenAI API over two replicas
behind the router (docs/CLUSTER.md, "Serving"). conformance-http passes and a
bench-serve run completes against it; ``/metrics`` has per-replica and router series; a
request migrated mid-stream keeps its greedy tokens; a slow replica does not stall the
other; SIGTERM drains every replica of the real command; a replica that dies is replaced
by a fresh one, up to its limit, its requests each ending once."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import (
    MODEL,
    TIMEOUT_S,
    cluster_config,
    cluster_loop,
    metric,
    start_cluster,
    stream_completion,
)

from refserve.cli.main import main
from refserve.cluster import InProcessReplica, ReplicaDead, Router
from refserve.core.transit import MigrationError
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.errors import InvalidArgument
from refserve.model.sampler import SamplingParams
from refserve.serve.cluster_loop import ClusterLoop
from refserve.serve.server import ServerThread

PROMPT = "The quick brown fox"


def _replica() -> InProcessReplica:
    return InProcessReplica(LLMEngine(MODEL, scheduler_config=cluster_config()))


@pytest.fixture(scope="module")
def cluster() -> Iterator[ServerThread]:
    handle = start_cluster([_replica(), _replica()], router="round_robin")
    yield handle
    handle.stop()


def _greedy(reference: LLMEngine, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (result,) = reference.generate([prompt], params)
    return result.outputs[0].text


def test_conformance_http_passes(cluster: ServerThread, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = ["conformance-http", "--base-url", cluster.base_url, "--model", MODEL]
    code = main([*argv, "--json", str(out), "--timeout", "30"])
    doc = json.loads(out.read_text())
    assert code == 0, doc
    assert doc["complete"] and {r["status"] for r in doc["results"]} == {"pass"}
    assert len(doc["results"]) == 11


def test_bench_serve_runs_and_metrics_name_both_replicas(
    cluster: ServerThread, tmp_path: Path
) -> None:
    before = [metric(cluster, "refserve:router_decisions_total", model_name=MODEL,
                     policy="round_robin", replica=str(r)) for r in (0, 1)]  # fmt: skip
    out = tmp_path / "bench.json"
    argv = ["bench-serve", "--base-url", cluster.base_url, "--model", MODEL, "--json", str(out)]
    extra = ["--trace", "chat", "--scale", "64", "--rate", "inf", "--num-requests", "8"]
    assert main([*argv, "--no-progress", *extra]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["summary"]["num_ok"] == 8 and run["summary"]["num_errors"] == 0
    after = [metric(cluster, "refserve:router_decisions_total", model_name=MODEL,
                    policy="round_robin", replica=str(r)) for r in (0, 1)]  # fmt: skip
    assert [a - b for a, b in zip(after, before, strict=True)] == [4.0, 4.0]  # round robin
    for r in ("0", "1"):
        assert metric(cluster, "vllm:generation_tokens_total", model_name=MODEL, replica=r) > 0
        assert metric(cluster, "refserve:replica_up", model_name=MODEL, replica=r) == 1.0
    assert cluster_loop(cluster).owners() == {}  # every request left the map


def test_a_request_migrated_mid_stream_keeps_its_tokens(cluster: ServerThread) -> None:
    loop = cluster_loop(cluster)
    reports: list[Any] = []
    seen = {"n": 0}

    def on_event(e: dict[str, Any]) -> None:
        seen["n"] += 1
        if seen["n"] == 3:  # a few tokens delivered: move it to the other replica
            rid = e["id"]
            src = loop.owners()[rid]
            reports.append(loop.migrate(rid, 1 - src, kv="transfer"))
            assert loop.owners()[rid] == 1 - src

    before = metric(cluster, "refserve:migrations_total", model_name=MODEL, outcome="done")
    out = stream_completion(cluster.base_url, PROMPT, 24, on_event)
    assert len(reports) == 1 and reports[0].kv_bytes > 0
    assert out["error"] is None and out["reason"] == "length"
    reference = LLMEngine(MODEL, scheduler_config=cluster_config())
    assert out["text"] == _greedy(reference, PROMPT, 24)
    after = metric(cluster, "refserve:migrations_total", model_name=MODEL, outcome="done")
    assert after == before + 1
    assert metric(cluster, "refserve:migration_bytes_total", model_name=MODEL) > 0


class SlowReplica(InProcessReplica):
    """A replica whose every step takes ``delay_s`` longer (a slow or overloaded host)."""

    delay_s = 0.15

    def step(self) -> list[RequestOutput]:
        time.sleep(self.delay_s)
        return super().step()


def test_a_slow_replica_does_not_stall_the_other() -> None:
    slow = SlowReplica(LLMEngine(MODEL, scheduler_config=cluster_config()))
    handle = start_cluster([slow, _replica()], router="round_robin")
    try:
        done: dict[str, float] = {}

        def run(name: str) -> None:
            t0 = time.monotonic()
            out = stream_completion(handle.base_url, PROMPT, 16, lambda e: None)
            assert out["reason"] == "length"
            done[name] = time.monotonic() - t0

        # Round robin: the first request goes to the slow replica 0, the second to 1.
        first = threading.Thread(target=run, args=("slow",), daemon=True)
        first.start()
        assert _wait(lambda: cluster_loop(handle).num_in_flight == 1)
        run("fast")
        first.join(TIMEOUT_S)
        # 16 tokens take at least 16 * 0.15 s on the slow one; the fast one must not
        # have waited for those steps.
        assert done["slow"] >= 16 * SlowReplica.delay_s
        assert done["fast"] < done["slow"] / 2, done
    finally:
        handle.stop()


def _wait(cond: Any, timeout_s: float = TIMEOUT_S) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def _completes(fut: Any, timeout_s: float) -> bool:
    try:
        fut.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        return False
    return True


def _serve(*extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "refserve.cli.main", "serve", "--model", MODEL, "--port", "0"]
    return subprocess.Popen(
        [*cmd, "--num-blocks", "64", "--torch-threads", "1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_the_command_serves_replicas_and_sigterm_drains_them() -> None:
    """``refserve serve --replicas 2``: streams in flight on both replicas when SIGTERM
    arrives still finish, then the process exits 0."""
    proc = _serve("--replicas", "2", "--router", "round_robin", "--drain-timeout", "20")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving 2 replicas (inprocess, round_robin)" in line, line
        base = line.split(" on ")[1].strip().removesuffix("/v1")
        results: list[dict[str, Any]] = []
        started = threading.Semaphore(0)

        def run() -> None:
            first = [True]

            def on_event(e: dict[str, Any]) -> None:
                if first[0]:
                    first[0] = False
                    started.release()

            results.append(stream_completion(base, PROMPT, 48, on_event))

        threads = [threading.Thread(target=run, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=TIMEOUT_S)
        metrics = httpx.get(f"{base}/metrics", timeout=TIMEOUT_S).text
        for r in (0, 1):  # one stream on each replica
            routed = f'router_decisions_total{{model_name="{MODEL}",policy="round_robin",'
            assert f'{routed}replica="{r}"}} 1.0' in metrics, metrics
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(TIMEOUT_S)
        assert proc.wait(timeout=TIMEOUT_S) == 0
        assert [r["reason"] for r in results] == ["length", "length"]
        assert "drained" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class DeadReplica(InProcessReplica):
    """A replica whose process is gone: found out at the first call that reaches it."""

    def add_request(self, token_ids: Any, params: SamplingParams, request_id: str) -> None:
        raise ReplicaDead(0, "the test's replica is gone")


def test_a_replica_found_dead_at_admission_is_routed_around() -> None:
    handle = start_cluster(
        [DeadReplica(LLMEngine(MODEL, scheduler_config=cluster_config())), _replica()],
        router="round_robin",
    )
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        url = f"{handle.base_url}/v1/completions"
        for _ in range(3):  # the first is routed to 0, found dead there, sent to 1
            r = httpx.post(url, json=body, timeout=TIMEOUT_S)
            assert r.status_code == 200, r.text
        assert metric(handle, "refserve:replica_up", model_name=MODEL, replica="0") == 0.0
        routed = [metric(handle, "refserve:router_decisions_total", model_name=MODEL,
                         policy="round_robin", replica=r) for r in ("0", "1")]  # fmt: skip
        assert routed == [0.0, 3.0]  # counted where they were served
        assert httpx.get(f"{handle.base_url}/health", timeout=TIMEOUT_S).status_code == 200
    finally:
        handle.stop()
    lone = start_cluster([DeadReplica(LLMEngine(MODEL, scheduler_config=cluster_config()))])
    try:
        r = httpx.post(f"{lone.base_url}/v1/completions", json=body, timeout=TIMEOUT_S)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert "every replica" in r.json()["error"]["message"]
        assert httpx.get(f"{lone.base_url}/health", timeout=TIMEOUT_S).status_code == 503
    finally:
        lone.stop()


@dataclass
class _Stream:
    """A greedy streamed completion read in a thread of its own, started and seen to
    deliver its first event (so it is live on a replica): its request id, and what
    ``stream_completion`` returns once the thread ends."""

    thread: threading.Thread
    request_id: str
    result: dict[str, Any]

    @staticmethod
    def start(base_url: str, max_tokens: int) -> _Stream:
        first = threading.Event()
        rid: list[str] = []
        result: dict[str, Any] = {}

        def on_event(e: dict[str, Any]) -> None:
            if not rid:
                rid.append(e["id"])
                first.set()

        thread = threading.Thread(
            target=lambda: result.update(stream_completion(base_url, PROMPT, max_tokens, on_event)),
            daemon=True,
        )
        thread.start()
        assert first.wait(TIMEOUT_S)
        return _Stream(thread, rid[0], result)


def test_an_abort_that_waited_through_a_migration_follows_the_request(
    cluster: ServerThread,
) -> None:
    """The abort of a client that went away, queued on the source while the request was
    moving, reaches the destination: the request ends (``abort``), not left running."""
    loop = cluster_loop(cluster)
    stream = _Stream.start(cluster.base_url, 400)
    src = loop.owners()[stream.request_id]
    a, b = loop.loops[src], loop.loops[1 - src]
    gate = threading.Event()
    b.run_sync(lambda: gate.wait(TIMEOUT_S))  # the destination's thread held
    moving = threading.Thread(target=lambda: loop.migrate(stream.request_id, b.index), daemon=True)
    moving.start()
    # The source exported and waits for the import (a no-op command there stays queued);
    # the abort queues behind it.
    assert _wait(lambda: not _completes(a.run_sync(lambda: None), 0.3))
    loop.abort(stream.request_id)
    gate.set()
    moving.join(TIMEOUT_S)
    stream.thread.join(TIMEOUT_S)
    assert stream.result["reason"] == "abort", stream.result
    assert b.run_sync(b.replica.request_ids).result(TIMEOUT_S) == ()
    assert a.run_sync(a.replica.request_ids).result(TIMEOUT_S) == ()
    assert loop.owners() == {}


def test_a_destination_that_does_not_import_in_time_leaves_the_request_running(
    cluster: ServerThread,
) -> None:
    """The destination's thread is held past the move's timeout: the move fails with a
    typed error naming it, the import it was sent is dropped when the thread comes back
    (never run late: the request would live twice), and the request finishes on the
    source with the greedy text, its stream unbroken."""
    loop = cluster_loop(cluster)
    # Read before the stream starts: the request must still be running when the move
    # begins, and an HTTP round trip in between can outlast a short generation on a
    # loaded machine.
    before = metric(cluster, "refserve:migrations_total", model_name=MODEL, outcome="aborted")
    stream = _Stream.start(cluster.base_url, 160)
    src = loop.owners()[stream.request_id]
    b = loop.loops[1 - src]
    gate = threading.Event()
    b.run_sync(lambda: gate.wait(TIMEOUT_S))  # the destination's thread held
    with pytest.raises(MigrationError, match=f"replica {b.index} did not import"):
        loop.migrate(stream.request_id, b.index, kv="transfer", timeout_s=0.5)
    assert loop.owners()[stream.request_id] == src
    gate.set()
    stream.thread.join(TIMEOUT_S)
    assert stream.result["error"] is None and stream.result["reason"] == "length", stream.result
    reference = LLMEngine(MODEL, scheduler_config=cluster_config())
    assert stream.result["text"] == _greedy(reference, PROMPT, 160)
    assert b.run_sync(b.replica.request_ids).result(TIMEOUT_S) == ()
    after = metric(cluster, "refserve:migrations_total", model_name=MODEL, outcome="aborted")
    assert after == before + 1


class DiesAtExport(InProcessReplica):
    """A replica found dead when a move reads it (its actor gone between two steps)."""

    def export_request(self, *args: Any, **kwargs: Any) -> Any:
        raise ReplicaDead(0, "gone at the export (planted)")


def test_a_source_found_dead_by_a_move_is_buried() -> None:
    """The driver reads the source from the caller's thread while the source's thread is
    parked; a death it meets there is the loop's to handle as any other: the move fails
    with it, the replica is buried, and its request ends once with the typed error."""
    engines = [LLMEngine(MODEL, scheduler_config=cluster_config()) for _ in range(2)]
    handle = start_cluster([DiesAtExport(e) for e in engines], router="round_robin")
    try:
        loop = cluster_loop(handle)
        stream = _Stream.start(handle.base_url, 400)
        src = loop.owners()[stream.request_id]
        with pytest.raises(ReplicaDead, match="gone at the export"):
            loop.migrate(stream.request_id, 1 - src)
        assert _wait(lambda: loop.loops[src].dead is not None)
        stream.thread.join(TIMEOUT_S)
        assert stream.result["error"] is not None, stream.result
        assert stream.request_id not in loop.owners()
    finally:
        handle.stop()


class MortalReplica(InProcessReplica):
    """An in-process replica that can die as a Ray one does: once ``doomed``, its next
    step raises :class:`ReplicaDead`, and so does every call after it."""

    def __init__(self, slot: int) -> None:
        super().__init__(LLMEngine(MODEL, scheduler_config=cluster_config()))
        self.slot, self.doomed, self.dead = slot, False, False

    def _check(self) -> None:
        if self.dead:
            raise ReplicaDead(self.slot, "killed by the test")

    def step(self) -> list[RequestOutput]:
        self.dead = self.dead or self.doomed
        self._check()
        return super().step()

    def add_request(self, token_ids: Any, params: SamplingParams, request_id: str) -> None:
        self._check()
        super().add_request(token_ids, params, request_id)

    def abort(self, request_id: str) -> None:
        self._check()
        super().abort(request_id)


def _post(handle: ServerThread, prompt: str, out: list[httpx.Response] | None = None) -> Any:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=TIMEOUT_S)
    if out is not None:
        out.append(r)
    return r


def test_a_dead_replica_is_replaced_up_to_its_limit(reference: LLMEngine) -> None:
    """Replica 0 dies while it streams A (tokens delivered) with B just added (nothing
    delivered): A ends once with the typed error, B is added on replica 1 and finishes
    once, and a fresh replica 0 rejoins with an empty cache and serves again. Killed
    again past ``max_restarts`` (1), it stays dead. /metrics counts it all."""
    made: list[MortalReplica] = []

    def restart(slot: int) -> MortalReplica:
        made.append(MortalReplica(slot))
        return made[-1]

    first = MortalReplica(0)
    handle = start_cluster([first, _replica()], restart=restart, max_restarts=1)
    loop = cluster_loop(handle)

    def m(name: str, replica: str = "0") -> float:
        return metric(handle, f"refserve:{name}", model_name=MODEL, replica=replica)

    try:
        started = threading.Event()
        a: dict[str, Any] = {}
        streaming = threading.Thread(
            target=lambda: a.update(
                stream_completion(handle.base_url, PROMPT, 300, lambda e: started.set())
            ),
            daemon=True,
        )
        streaming.start()  # round robin: A to 0
        assert started.wait(TIMEOUT_S)
        assert _post(handle, "Hello").status_code == 200  # to 1
        gate = threading.Event()
        loop.loops[0].run_sync(lambda: gate.wait(TIMEOUT_S))  # 0 holds between two steps
        b: list[httpx.Response] = []
        sending = threading.Thread(target=_post, args=(handle, "Count to four.", b), daemon=True)
        sending.start()  # B to 0: its add queues behind the gate, then 0's step dies
        assert _wait(lambda: len(loop.decisions) == 3)
        time.sleep(0.2)  # the add is queued right after the routing
        first.doomed = True
        gate.set()
        streaming.join(TIMEOUT_S)
        sending.join(TIMEOUT_S)
        err = a["error"]
        assert err is not None and err["code"] == 503 and "replica 0 is dead" in err["message"]
        assert a["reason"] is None and _greedy(reference, PROMPT, 300).startswith(a["text"])
        assert b[0].status_code == 200, b[0].text  # once, on replica 1
        assert b[0].json()["choices"][0]["text"] == _greedy(reference, "Count to four.", 6)
        assert _wait(lambda: m("replica_up") == 1.0)
        assert len(made) == 1 and loop.loops[0].replica is made[0]
        # Rejoined from its own (empty) cache: A's prompt, cached on the dead one, is not.
        ids = reference.tokenizer.encode(PROMPT * 8, add_special_tokens=True)
        assert loop.index.longest_prefix(ids).get(0) == 0
        figures = {n: m(n) for n in ("replica_deaths_total", "replica_restarts_total",
                                     "replica_restarted_requests_total",
                                     "replica_failed_requests_total")}  # fmt: skip
        assert figures == dict.fromkeys(figures, 1.0), figures
        before = metric(handle, "refserve:router_decisions_total", model_name=MODEL,
                        policy="round_robin", replica="0")  # fmt: skip
        for _ in range(2):  # one of them on the fresh replica 0
            assert _post(handle, "Hello").status_code == 200
        after = metric(handle, "refserve:router_decisions_total", model_name=MODEL,
                       policy="round_robin", replica="0")  # fmt: skip
        assert after == before + 1
        # Past its limit: killed again, it stays dead; its request goes to replica 1.
        made[0].doomed = True
        for _ in range(2):
            assert _post(handle, "Hello").status_code == 200
        assert _wait(lambda: not loop.loops[0].alive)
        assert m("replica_up") == 0.0 and m("replica_deaths_total") == 2.0
        assert m("replica_restarts_total") == 1.0 and len(made) == 1
        assert loop.owners() == {} and loop.num_in_flight == 0
    finally:
        handle.stop()


def test_bad_restart_settings_are_typed_errors() -> None:
    rep = _replica()
    args: dict[str, Any] = {"tokenizer": rep.engine.tokenizer, "max_model_len": 64,
                            "scheduler_config": cluster_config()}  # fmt: skip
    for bad in (-1, True, 2.0, "3"):
        with pytest.raises(InvalidArgument, match="max_restarts"):
            ClusterLoop([rep], Router(), restart=lambda _: _replica(), max_restarts=bad, **args)
    with pytest.raises(InvalidArgument, match="needs a restart factory"):
        ClusterLoop([rep], Router(), max_restarts=2, **args)
    with pytest.raises(InvalidArgument, match="restart must"):
        ClusterLoop([rep], Router(), restart=3, max_restarts=1, **args)  # type: ignore[arg-type]
