"""Prefill/decode disaggregation behind the server: ``refserve serve --replicas 4
--roles 2P2D`` (docs/DISAGG.md, "Serving"; ref/serve/cluster_pd.py).

- conformance-http passes and a bench-serve run completes against two prefill and two
  decode replicas in process; requests are placed on the prefill replicas only and
  handed off to the decode ones;
- a streamed request across the handoff: its text is the single engine's greedy text,
  each token arrives once (its first from the prefill replica, the rest from the decode
  one);
- deflection: with the prefill side's predicted TTFT past the SLO (a prefill replica
  reporting a long backlog), a request prefills and decodes on a decode replica that
  keeps its steps within the TBT bound, never handed off, its text the greedy one;
- a decode replica that dies on import, or does not import in time: the request stays
  on its prefill replica and finishes there with the greedy text, nothing twice; the
  handoff counts as kept, and the late import never runs;
- the real command with ``--roles 2P2D`` starts and serves; a bad ``--roles`` is one
  error line;
- the same on the Ray backend (Ray started for this module, only if that test runs):
  conformance-http and a streamed request across the handoff.
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
from collections.abc import Callable, Iterator
from dataclasses import replace
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
    sse_events,
    start_cluster,
    stream_completion,
)

from refserve.cli.main import main
from refserve.cluster import InProcessReplica, ReplicaDead, Router
from refserve.cluster.disagg import Deflection, Phase, Roles, TTFTBound
from refserve.cluster.records import LoadFigures
from refserve.core.cost import StepCost
from refserve.engine.llm_engine import LLMEngine
from refserve.engine.ticket import MigrationTicket
from refserve.model.sampler import SamplingParams
from refserve.serve.app import ServeSettings
from refserve.serve.cluster_loop import ClusterLoop
from refserve.serve.metrics import ClusterServeMetrics
from refserve.serve.server import ServerThread, build_cluster_server

PROMPT = "The quick brown fox"


def _replica() -> InProcessReplica:
    return InProcessReplica(LLMEngine(MODEL, scheduler_config=cluster_config()))


@pytest.fixture(scope="module")
def pd() -> Iterator[ServerThread]:
    handle = start_cluster(
        [_replica() for _ in range(4)], router="round_robin", roles=Roles.parse("2P2D", 4)
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(MODEL, scheduler_config=cluster_config())


def _greedy(reference: LLMEngine, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (result,) = reference.generate([prompt], params)
    return result.outputs[0].text


def _tokens(handle: ServerThread, replica: int) -> float:
    return metric(handle, "vllm:generation_tokens_total", model_name=MODEL, replica=str(replica))


def _handoffs(handle: ServerThread) -> float:
    return sum(
        metric(handle, "refserve:handoffs_total", model_name=MODEL, replica=str(r))
        for r in range(len(cluster_loop(handle).loops))
    )


def _kept(handle: ServerThread, reason: str) -> float:
    return metric(handle, "refserve:handoffs_kept_total", model_name=MODEL, reason=reason)


def _stream(base_url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A greedy streamed completion with its usage: the text, the finish reasons (one
    per final event), the completion tokens counted and any error events."""
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    out: dict[str, Any] = {"text": "", "reasons": [], "usage": None, "errors": []}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        for e in sse_events(r):
            if "error" in e:
                out["errors"].append(e["error"])
                continue
            out["usage"] = e.get("usage") or out["usage"]
            for ch in e["choices"]:
                out["text"] += ch["text"]
                if ch["finish_reason"]:
                    out["reasons"].append(ch["finish_reason"])
    return out


def _generated(handle: ServerThread) -> dict[int, float]:
    """Tokens each replica's outputs carried to the clients (``vllm:generation_tokens``)."""
    return {r: _tokens(handle, r) for r in range(len(cluster_loop(handle).loops))}


def test_conformance_http_passes_with_roles(pd: ServerThread, tmp_path: Path) -> None:
    before = _handoffs(pd)
    out = tmp_path / "report.json"
    argv = ["conformance-http", "--base-url", pd.base_url, "--model", MODEL]
    code = main([*argv, "--json", str(out), "--timeout", "30"])
    doc = json.loads(out.read_text())
    assert code == 0, doc
    assert doc["complete"] and {r["status"] for r in doc["results"]} == {"pass"}
    assert _handoffs(pd) > before  # its requests went through the handoff


def test_bench_serve_places_on_prefill_and_hands_off_to_decode(
    pd: ServerThread, tmp_path: Path
) -> None:
    def routed(r: int) -> float:
        return metric(pd, "refserve:router_decisions_total", model_name=MODEL,
                      policy="round_robin", replica=str(r))  # fmt: skip

    before = [routed(r) for r in range(4)]
    handed = _handoffs(pd)
    out = tmp_path / "bench.json"
    argv = ["bench-serve", "--base-url", pd.base_url, "--model", MODEL, "--json", str(out)]
    extra = ["--trace", "chat", "--scale", "64", "--rate", "inf", "--num-requests", "8"]
    assert main([*argv, "--no-progress", *extra]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["summary"]["num_ok"] == 8 and run["summary"]["num_errors"] == 0
    # Round robin among the prefill replicas only: four each, none on 2 and 3.
    assert [routed(r) - b for r, b in zip(range(4), before, strict=True)] == [4, 4, 0, 0]
    assert _handoffs(pd) > handed
    for r in (2, 3):
        assert metric(pd, "refserve:handoffs_total", model_name=MODEL, replica=str(r)) > 0
    assert cluster_loop(pd).owners() == {}  # every request left the map


def test_a_stream_across_the_handoff_is_the_greedy_one_each_token_once(
    pd: ServerThread, reference: LLMEngine
) -> None:
    """The text is the greedy one, in order; 24 tokens reached the client, each once:
    one in the prefill replica's outputs, 23 in the decode replica's, one final."""
    loop = cluster_loop(pd)
    before = _generated(pd)
    handed = _handoffs(pd)
    kv_before = metric(pd, "refserve:handoff_bytes_total", model_name=MODEL)
    out = _stream(pd.base_url, PROMPT, 24)
    assert out["errors"] == [] and out["reasons"] == ["length"]
    assert out["text"] == _greedy(reference, PROMPT, 24)
    assert out["usage"]["completion_tokens"] == 24
    assert _handoffs(pd) == handed + 1
    assert metric(pd, "refserve:handoff_bytes_total", model_name=MODEL) > kv_before
    delta = {r: n - before[r] for r, n in _generated(pd).items()}
    assert delta[0] + delta[1] == 1 and delta[2] + delta[3] == 23, delta
    assert loop.owners() == {} and loop.num_in_flight == 0


class DiesOnImport(InProcessReplica):
    """A decode replica whose process goes away as a handoff reaches it."""

    def import_request(self, ticket: MigrationTicket) -> list[str]:
        raise ReplicaDead(1, "the test's decode replica died on import")


def test_a_decode_replica_dying_on_import_leaves_the_request_on_prefill(
    reference: LLMEngine,
) -> None:
    dying = DiesOnImport(LLMEngine(MODEL, scheduler_config=cluster_config()))
    handle = start_cluster([_replica(), dying], roles=Roles.parse("1P1D", 2))
    try:
        loop = cluster_loop(handle)
        text = _greedy(reference, PROMPT, 16)
        out = _stream(handle.base_url, PROMPT, 16)
        # Kept on the prefill replica: it decoded there to the greedy end, each token once.
        assert out["errors"] == [] and out["reasons"] == ["length"], out
        assert out["text"] == text and out["usage"]["completion_tokens"] == 16
        assert _generated(handle) == {0: 16, 1: 0}
        assert _kept(handle, "failed") == 1 and _handoffs(handle) == 0
        assert metric(handle, "refserve:replica_up", model_name=MODEL, replica="1") == 0.0
        # No decode replica left: the next request is kept for want of one, served whole.
        again = _stream(handle.base_url, PROMPT, 16)
        assert again["errors"] == [] and again["text"] == text
        assert _kept(handle, "no_decode") == 1
        assert loop.owners() == {} and loop.num_in_flight == 0
    finally:
        handle.stop()


class Backlogged(InProcessReplica):
    """A prefill replica that reports a long prefill backlog (a queue of long prompts)."""

    def load(self) -> LoadFigures:
        return replace(super().load(), prefill_backlog_tokens=1_000_000)


def test_a_prefill_past_its_ttft_slo_is_deflected_to_a_decode_replica(
    reference: LLMEngine,
) -> None:
    tbt = 50.0
    d_cfg = replace(cluster_config(), tbt_slo_ms=tbt, step_cost=StepCost())
    decode = InProcessReplica(LLMEngine(MODEL, scheduler_config=d_cfg))
    prefill = Backlogged(LLMEngine(MODEL, scheduler_config=cluster_config()))
    deflection = Deflection(TTFTBound(200.0), tbt_slo_ms=tbt)
    handle = start_cluster([prefill, decode], roles=Roles.parse("1P1D", 2), deflection=deflection)
    try:
        loop = cluster_loop(handle)
        seen: list[Phase | None] = []
        out = stream_completion(
            handle.base_url, PROMPT, 12, lambda e: seen.append(loop.handoffs.phase(e["id"]))
        )
        assert out["error"] is None and out["reason"] == "length"
        assert out["text"] == _greedy(reference, PROMPT, 12)
        assert set(seen) <= {Phase.DEFLECTED, None} and Phase.DEFLECTED in seen
        assert metric(handle, "refserve:deflections_total", model_name=MODEL, replica="1") == 1
        assert _generated(handle) == {0: 0, 1: 12} and _handoffs(handle) == 0
    finally:
        handle.stop()


def _wait(cond: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_a_decode_replica_late_to_import_keeps_the_request(reference: LLMEngine) -> None:
    """The decode replica's thread is held past the handoff's timeout: the prefill
    replica keeps the request and decodes it to the greedy end; the import it sent is
    dropped when the decode thread comes back (never run late: the request would live
    twice); the book forgets the request once it ended."""
    reps = [_replica(), _replica()]
    loop = ClusterLoop(
        reps,
        Router("round_robin"),
        tokenizer=reps[0].engine.tokenizer,
        max_model_len=reps[0].engine.max_model_len,
        scheduler_config=cluster_config(),
        metrics=ClusterServeMetrics(MODEL),
        roles=Roles.parse("1P1D", 2),
        handoff_timeout_s=0.5,
    )
    handle = ServerThread(build_cluster_server(loop, ServeSettings(MODEL, drain_timeout_s=5.0)))
    handle.start()
    try:
        gate = threading.Event()
        d = loop.loops[1]
        d.run_sync(lambda: gate.wait(TIMEOUT_S))  # the decode replica's thread held
        out = _stream(handle.base_url, PROMPT, 16)
        gate.set()
        assert out["errors"] == [] and out["reasons"] == ["length"], out
        assert out["text"] == _greedy(reference, PROMPT, 16)
        assert _kept(handle, "failed") == 1 and _handoffs(handle) == 0
        assert d.run_sync(d.replica.request_ids).result(TIMEOUT_S) == ()
        assert _generated(handle) == {0: 16, 1: 0}
        assert _wait(lambda: loop.owners() == {} and loop.num_in_flight == 0)
        assert _wait(lambda: not loop.handoffs.num_booked())
    finally:
        handle.stop()


def _serve(*extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "refserve.cli.main", "serve", "--model", MODEL, "--port", "0"]
    return subprocess.Popen(
        [*cmd, "--num-blocks", "64", "--torch-threads", "1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_the_command_serves_with_roles_and_drains(reference: LLMEngine) -> None:
    proc = _serve("--replicas", "4", "--roles", "2P2D", "--deflect-ttft-ms", "500,1",
                  "--deflect-tbt-ms", "50", "--drain-timeout", "10")  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving 4 replicas (inprocess, prefix_aware, roles 2P2D)" in line, line
        base = line.split(" on ")[1].strip().removesuffix("/v1")
        out = _stream(base, PROMPT, 12)
        assert out["errors"] == [] and out["text"] == _greedy(reference, PROMPT, 12)
        metrics = httpx.get(f"{base}/metrics", timeout=TIMEOUT_S).text
        assert "refserve:handoffs_total" in metrics, metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


BAD_ROLES: list[tuple[str, list[str], str]] = [
    ("count", ["--replicas", "4", "--roles", "2P1D"], "name 3 replicas"),
    ("letter", ["--replicas", "2", "--roles", "1P1X"], "names no role"),
    ("no decode", ["--replicas", "2", "--roles", "2P"], "none that decodes"),
    ("one engine", ["--roles", "1C"], "--roles"),
    ("deflect alone", ["--replicas", "2", "--roles", "1P1D", "--deflect-tbt-ms", "50"],
     "go together"),
    ("deflect no D", ["--replicas", "2", "--roles", "1P1C", "--deflect-ttft-ms", "100",
                      "--deflect-tbt-ms", "50"], "no decode replica"),
    ("ttft text", ["--replicas", "2", "--deflect-ttft-ms", "1,2,3"], "--deflect-ttft-ms"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "argv", "names"), BAD_ROLES, ids=[c for c, _, _ in BAD_ROLES])
def test_bad_roles_are_one_error_line(case: str, argv: list[str], names: str, capsys: Any) -> None:
    assert main(["serve", "--model", MODEL, "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refserve: error:") and err.count("\n") == 1, err
    assert names in err and "Traceback" not in err


# ---------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """Ray, started once for this module if a test here needs it (its loopback switch
    read at import: ref/cluster/ray_replica.py), stopped at the module's end."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is the optional [cluster] extra: `make cluster-deps` installs it")
    from refserve.cluster.ray_replica import start_ray, stop_ray

    started = start_ray()
    yield
    if started:
        stop_ray()


def test_ray_backend_with_roles_passes_conformance_and_hands_off(
    ray_local: None, reference: LLMEngine, tmp_path: Path
) -> None:
    from refserve.cli import serve as serve_cli
    from refserve.cli.main import _parser
    from refserve.cluster.ray_replica import RayReplica

    argv = ["serve", "--model", MODEL, "--replicas", "4", "--backend", "ray", "--roles", "2P2D",
            "--router", "round_robin", "--block-size", "16", "--num-blocks", "128",
            "--torch-threads", "2"]  # fmt: skip
    args = _parser().parse_args(argv)
    built = serve_cli.cluster_loop(args, serve_cli.config_from_args(args), MODEL)
    reps = [lp.replica for lp in built.loops]
    assert all(isinstance(r, RayReplica) for r in reps) and len(reps) == 4
    handle = ServerThread(build_cluster_server(built, ServeSettings(MODEL, drain_timeout_s=5.0)))
    handle.start()
    try:
        out = tmp_path / "conformance.json"
        code = main(["conformance-http", "--base-url", handle.base_url, "--model", MODEL,
                     "--json", str(out), "--timeout", "30"])  # fmt: skip
        doc = json.loads(out.read_text())
        assert code == 0 and {r["status"] for r in doc["results"]} == {"pass"}, doc
        before = _generated(handle)
        streamed = _stream(handle.base_url, PROMPT, 16)
        assert streamed["errors"] == [] and streamed["reasons"] == ["length"]
        assert streamed["text"] == _greedy(reference, PROMPT, 16)
        assert streamed["usage"]["completion_tokens"] == 16
        delta = {r: n - before[r] for r, n in _generated(handle).items()}
        assert delta[0] + delta[1] == 1 and delta[2] + delta[3] == 15, delta
        assert _handoffs(handle) > 0
    finally:
        handle.stop()
        for r in reps:
            assert isinstance(r, RayReplica)
            r.kill()
