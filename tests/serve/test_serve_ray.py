"""The Ray transport (ref/cluster/ray_replica.py), in the cluster and behind the server
(docs/CLUSTER.md, "Transports", "Serving", "Faults"). Ray starts once for the module
(locally, 2 CPUs, no dashboard) and is shut down at its end.

- Every process of the local Ray instance (and this driver) listens on loopback only:
  the listening sockets of this process and its descendants, found with psutil; a Ray
  imported before its loopback switch was set is refused, before anything starts.
- The same ``Cluster`` code drives two Ray replicas: greedy requests, one migrated by
  ticket bytes between the actors mid-decode, give one in-process engine's tokens, the
  ownership rule holding after every step.
- A server over two Ray replicas, built as ``refserve serve --replicas 2 --backend ray``
  builds it, passes conformance-http, serves concurrent streams, migrates one of them
  mid-stream (its text unchanged), and stops cleanly.
- A replica that does not answer a call within its timeout is dead: its actor killed,
  its request ended once with ``ReplicaDead``, the other replica serving on.
- A replica's actor killed (SIGKILL) mid-request: that stream ends with a typed error
  event (503 ``service_unavailable`` naming the replica), its delivered text a prefix of
  the right one (nothing lost silently, nothing twice); a fresh actor takes the dead
  one's place (``replica_up`` 1 again, one restart counted) and serves its share again;
  an idle replica killed is found by its ping and replaced too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

# Ray itself is imported by start_ray (the module fixture), never here: it must read its
# loopback switch at import (ref/cluster/ray_replica.py, ``LOOPBACK_ENV``).
if importlib.util.find_spec("ray") is None:
    pytest.skip(
        "Ray is the optional [cluster] extra: `make cluster-deps` installs it",
        allow_module_level=True,
    )

from serve_helpers import (  # after the skip: no Ray, no import
    MODEL,
    TIMEOUT_S,
    cluster_config,
    cluster_loop,
    metric,
    start_cluster,
    stream_completion,
)

from refserve.cli import serve as serve_cli
from refserve.cli.main import _parser, main
from refserve.cluster import Cluster, ReplicaDead, Router
from refserve.cluster.ray_replica import (
    LOOPBACK_ENV,
    RayReplica,
    ray_replicas,
    start_ray,
    stop_ray,
)
from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine
from refserve.errors import InvalidArgument
from refserve.model.sampler import SamplingParams
from refserve.serve.app import ServeSettings
from refserve.serve.server import ServerThread, build_cluster_server

PROMPTS = ["The quick brown fox", "Hello", "Count to four.", "a" * 40]


@pytest.fixture(scope="module", autouse=True)
def ray_local() -> Iterator[None]:
    started = start_ray()
    yield
    if started:
        stop_ray()


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(MODEL, scheduler_config=cluster_config())


def _greedy(reference: LLMEngine, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (result,) = reference.generate([prompt], params)
    return result.outputs[0].text


def _server(replicas: list[RayReplica], reference: LLMEngine) -> ServerThread:
    """Round robin over ``replicas``; a dead one replaced once by a fresh actor."""
    return start_cluster(
        replicas,
        router="round_robin",
        tokenizer=reference.tokenizer,
        max_model_len=replicas[0].max_model_len,
        restart=lambda slot: ray_replicas(1, scheduler_config=cluster_config(), first_id=slot)[0],
        max_restarts=1,
    )


#: The loopback addresses: IPv4's, IPv6's, and IPv4's as an IPv6 socket shows it (a
#: dual-stack socket bound to 127.0.0.1 reads ::ffff:127.0.0.1).
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listening() -> dict[int, tuple[str, list[str]]]:
    """Every TCP socket listening, and UDP socket bound, in this process and its
    descendants (the Ray processes start_ray started: GCS, raylet, the agents, the
    workers, the actors), by pid: the process name and the addresses."""
    import psutil  # Ray's own copy (ray/thirdparty_files), on the path once Ray is imported

    me = psutil.Process()
    out: dict[int, tuple[str, list[str]]] = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            tcp = p.net_connections(kind="tcp")
            udp = p.net_connections(kind="udp")  # a bound datagram socket listens too
            name = p.name()
        except psutil.NoSuchProcess:  # ended meanwhile (an idle worker): nothing to see
            continue
        addrs = [f"{c.laddr.ip} port {c.laddr.port}" for c in tcp if c.status == "LISTEN"]
        addrs += [f"{c.laddr.ip} port {c.laddr.port}" for c in udp if c.laddr]
        if addrs:
            out[p.pid] = (name, addrs)
    return out


def test_the_local_ray_cluster_listens_on_loopback_only() -> None:
    """Nothing Ray started here (start_ray, then an actor) listens off loopback: not the
    GCS, the raylet, the runtime-env agent, a worker, an actor, nor this driver."""
    (rep,) = ray_replicas(1)
    try:
        found = _listening()
        names = {name for name, _ in found.values()}
        # The check sees the processes that matter: else it could pass on nothing.
        assert {"gcs_server", "raylet"} <= names and rep.pid in found, found
        off = {
            pid: (name, [a for a in addrs if a.split(" port ")[0] not in LOOPBACK])
            for pid, (name, addrs) in found.items()
        }
        off = {pid: v for pid, v in off.items() if v[1]}
        assert off == {}, f"listening off loopback: {off}"
    finally:
        rep.kill()


def test_start_ray_refuses_a_ray_imported_without_its_loopback_switch() -> None:
    """Ray imported first (it read its switch unset): start_ray refuses, typed, before
    any Ray process starts (a process of its own: this one's Ray is running)."""
    code = (
        "import ray\n"
        "from refserve.cluster.ray_replica import start_ray\n"
        "from refserve.cluster.errors import ClusterError\n"
        "try:\n"
        "    start_ray()\n"
        "except ClusterError as e:\n"
        "    print('refused:', e, ray.is_initialized())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != LOOPBACK_ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "refused: start_ray: Ray was imported before" in out.stdout, out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("False")  # nothing started


def test_cluster_on_ray_migrates_by_ticket_and_matches_one_engine() -> None:
    cfg = SchedulerConfig(
        num_blocks=64, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=True
    )
    reps = ray_replicas(2, scheduler_config=cfg)
    try:
        assert len({r.pid for r in reps}) == 2 and os.getpid() not in {r.pid for r in reps}
        cluster = Cluster(reps, Router("round_robin"))
        single = Cluster.in_process(1, scheduler_config=cfg)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [list(range(1 + i, 20 + i)) for i in range(4)]
        for c in (cluster, single):
            for i, p in enumerate(prompts):
                c.add_request(p, params, request_id=f"r{i}")
        finals: dict[str, tuple[int, ...]] = {}
        moved = []
        for step in range(200):
            if not cluster.has_work:
                break
            if step == 4:  # mid-decode (the prompts are prefilled by then)
                src = cluster.owner("r0")
                moved.append(cluster.migrate("r0", 1 - src, kv="transfer"))
                assert cluster.owner("r0") == 1 - src
            for o in cluster.step():
                if o.finished:
                    assert o.request_id not in finals
                    finals[o.request_id] = o.token_ids
            assert cluster.ownership_violations() == []
        want: dict[str, tuple[int, ...]] = {}
        while single.has_work:
            want.update({o.request_id: o.token_ids for o in single.step() if o.finished})
        assert finals == want
        (report,) = moved
        assert report.kv_bytes > 0 and cluster.metrics.migrations == 1
        assert cluster.metrics.migration_bytes == report.kv_bytes
    finally:
        for r in reps:
            r.kill()


def test_server_on_ray_streams_migrates_and_stops(reference: LLMEngine, tmp_path: Path) -> None:
    argv = ["serve", "--model", MODEL, "--replicas", "2", "--backend", "ray",
            "--router", "round_robin", "--block-size", "16", "--num-blocks", "128",
            "--torch-threads", "2"]  # fmt: skip
    args = _parser().parse_args(argv)
    built = serve_cli.cluster_loop(args, serve_cli.config_from_args(args), MODEL)
    reps = [lp.replica for lp in built.loops]
    assert all(isinstance(r, RayReplica) for r in reps) and len(reps) == 2
    server = build_cluster_server(built, ServeSettings(MODEL, drain_timeout_s=5.0))
    handle = ServerThread(server).start()
    try:
        loop = cluster_loop(handle)
        out = tmp_path / "conformance.json"
        code = main(["conformance-http", "--base-url", handle.base_url, "--model", MODEL,
                     "--json", str(out), "--timeout", "30"])  # fmt: skip
        doc = json.loads(out.read_text())
        assert code == 0 and {r["status"] for r in doc["results"]} == {"pass"}, doc
        results: dict[int, dict[str, Any]] = {}
        moved: list[Any] = []

        def on_event(i: int) -> Any:
            seen = [0]

            def hook(e: dict[str, Any]) -> None:
                seen[0] += 1
                if i == 0 and seen[0] == 3:
                    rid = e["id"]
                    src = loop.owners()[rid]
                    moved.append(loop.migrate(rid, 1 - src, kv="transfer"))

            return hook

        def run(i: int) -> None:
            results[i] = stream_completion(handle.base_url, PROMPTS[i], 24, on_event(i))

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        assert len(moved) == 1 and moved[0].kv_bytes > 0
        for i in range(4):
            assert results[i]["error"] is None and results[i]["reason"] == "length"
            assert results[i]["text"] == _greedy(reference, PROMPTS[i], 24), i
        for r in ("0", "1"):
            assert metric(handle, "vllm:generation_tokens_total", model_name=MODEL, replica=r) > 0
        assert metric(handle, "refserve:migrations_total", model_name=MODEL, outcome="done") == 1
    finally:
        handle.stop()
    assert not any(lp.alive for lp in cluster_loop(handle).loops)  # every replica thread
    assert cluster_loop(handle).num_in_flight == 0
    for r in reps:
        assert isinstance(r, RayReplica)
        r.kill()


def test_a_replica_that_does_not_answer_in_time_is_dead_and_killed() -> None:
    """A hung replica (here: one given 0.1 ms to answer a step) counts as dead: its
    actor is killed, its request ends once with ReplicaDead saying why, and the other
    replica goes on serving."""
    with pytest.raises(InvalidArgument, match="call_timeout_s"):
        ray_replicas(1, call_timeout_s=0)  # refused before any actor starts
    with pytest.raises(InvalidArgument, match="first_id"):
        ray_replicas(1, first_id=-1)
    reps = ray_replicas(2, scheduler_config=cluster_config())
    try:
        c = Cluster(reps, Router("round_robin"))
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        c.add_request([1, 2, 3, 4, 5], params, request_id="hung")
        assert c.owner("hung") == 0
        reps[0].call_timeout_s = 1e-4
        c.step()
        failures = c.take_failures()
        assert list(failures) == ["hung"] and "no answer within 0.0001 s" in str(failures["hung"])
        assert c.dead.keys() == {0} and c.ownership_violations() == []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the actor's process goes away
            try:
                os.kill(reps[0].pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the hung replica's actor was not killed")
        c.add_request([1, 2, 3], params, request_id="after")
        assert c.owner("after") == 1
        finals = {o.request_id: o for _ in range(50) if c.has_work for o in c.step()}
        assert finals["after"].finished and len(finals["after"].token_ids) == 4
    finally:
        reps[1].kill()


def _wait_back(handle: ServerThread, replica: str) -> None:
    """Until ``replica`` died once and came back once (/metrics)."""
    figures = ("replica_deaths_total", "replica_restarts_total", "replica_up")
    deadline = time.monotonic() + 90
    while True:
        got = [metric(handle, f"refserve:{n}", model_name=MODEL, replica=replica) for n in figures]
        if got == [1.0, 1.0, 1.0]:
            return
        assert time.monotonic() < deadline, f"replica {replica} did not come back: {got}"
        time.sleep(0.2)


def test_a_killed_replica_ends_its_requests_with_a_typed_error(reference: LLMEngine) -> None:
    reps = ray_replicas(2, scheduler_config=cluster_config())
    handle = _server(reps, reference)
    try:
        loop = cluster_loop(handle)
        killed = threading.Event()

        def kill_after_some_tokens(e: dict[str, Any]) -> None:
            text = "".join(ch.get("text", "") for ch in e.get("choices", []))
            if text and not killed.is_set():
                assert loop.owners()[e["id"]] == 0  # round robin: the first goes to 0
                os.kill(reps[0].pid, signal.SIGKILL)
                killed.set()

        out = stream_completion(handle.base_url, PROMPTS[0], 200, kill_after_some_tokens)
        assert killed.is_set()
        err = out["error"]
        assert err is not None and err["type"] == "service_unavailable" and err["code"] == 503
        assert "replica 0 is dead" in err["message"]
        assert out["reason"] is None  # never reported finished
        # What was delivered is the start of the right text: nothing skipped or repeated.
        assert _greedy(reference, PROMPTS[0], 200).startswith(out["text"]) and out["text"]
        assert metric(handle, "refserve:replica_deaths_total", model_name=MODEL,
                      replica="0") == 1.0  # fmt: skip
        failed = metric(handle, "refserve:replica_failed_requests_total", model_name=MODEL,
                        replica="0")  # fmt: skip
        assert failed == 1.0
        # A fresh actor takes its place, rejoins from its empty cache, and serves again.
        _wait_back(handle, "0")
        fresh = loop.loops[0].replica
        assert isinstance(fresh, RayReplica) and fresh.pid != reps[0].pid
        assert loop.owners() == {}
        # An idle replica's death is found by its ping: replica 1 killed with no request.
        os.kill(reps[1].pid, signal.SIGKILL)
        _wait_back(handle, "1")
        assert loop.loops[1].replica is not reps[1]
        before = {r: metric(handle, "refserve:router_decisions_total", model_name=MODEL,
                            policy="round_robin", replica=r) for r in ("0", "1")}  # fmt: skip
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        for _ in range(4):
            r = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=TIMEOUT_S)
            assert r.status_code == 200, r.text
        after = {r: metric(handle, "refserve:router_decisions_total", model_name=MODEL,
                           policy="round_robin", replica=r) for r in ("0", "1")}  # fmt: skip
        assert after == {r: before[r] + 2 for r in ("0", "1")}  # the fresh one serves
        assert httpx.get(f"{handle.base_url}/health", timeout=TIMEOUT_S).status_code == 200
        with pytest.raises(ReplicaDead, match="replica 0"):
            reps[0].step()  # the dead actor's handle stays dead
    finally:
        t0 = time.monotonic()
        handle.stop()
        assert time.monotonic() - t0 < 15  # a dead replica does not hold up the drain
        for r in {*reps, *(lp.replica for lp in cluster_loop(handle).loops)}:
            assert isinstance(r, RayReplica)
            r.kill()  # the dead ones too: a no-op
