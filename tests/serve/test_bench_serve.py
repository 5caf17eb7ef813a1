"""``refserve bench-serve`` against ``refserve serve`` (records match the requests sent),
and against servers that fail (errors counted, bounded in time, no traceback)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from serve_helpers import MODEL

from refserve.cli.main import main
from refserve.serve.bench import plan
from refserve.serve.server import ServerThread


def _bench(base: str, tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "bench.json"
    argv = ["bench-serve", "--base-url", base, "--model", MODEL, "--json", str(out)]
    code = main([*argv, "--no-progress", *extra])
    return code, json.loads(out.read_text()) if out.exists() else {}


def test_chat_trace_against_refserve_serve(server: ServerThread, tmp_path: Path) -> None:
    code, doc = _bench(
        server.base_url, tmp_path, "--trace", "chat", "--scale", "64", "--rate", "inf",
        "--num-requests", "8",
    )  # fmt: skip
    assert code == 0
    (run,) = doc["runs"]
    s, reqs = run["summary"], run["requests"]
    assert s["num_ok"] == 8 and s["num_errors"] == 0 and s["rate"] == "inf"
    planned = {
        p.id: p
        for p in plan("chat", rate=math.inf, num_requests=8, duration_s=None, scale=64, seed=0)
    }
    assert sorted(planned) == sorted(r["id"] for r in reqs)
    for r in reqs:
        p = planned[r["id"]]
        assert r["status"] == "ok" and r["finish_reason"] == "length"
        assert r["tokens_out"] == p.max_tokens  # ignore_eos: exactly max_tokens
        assert r["tokens_in"] == len(p.prompt) + 1  # the byte tokenizer: + BOS
        assert r["sent_s"] <= r["first_token_s"] <= r["token_times_s"][-1] <= r["finish_s"]
    assert s["ttft_p50_ms"] > 0 and s["output_tokens_per_s"] > 0


def test_sweep_and_agent_sessions(server: ServerThread, tmp_path: Path) -> None:
    code, doc = _bench(
        server.base_url, tmp_path, "--trace", "agent", "--scale", "128", "--sweep", "50,100",
        "--num-requests", "6",
    )  # fmt: skip
    assert code == 0
    assert [r["summary"]["rate"] for r in doc["runs"]] == [50, 100]
    assert doc["knee_rate"] in (None, 50, 100)
    reqs = doc["runs"][0]["requests"]
    assert all(r["status"] == "ok" for r in reqs)
    # Each turn sends the conversation so far: prompts grow within a session.
    by_session: dict[str, list[int]] = {}
    for r in reqs:
        by_session.setdefault(r["id"].rsplit("-", 1)[0], []).append(r["tokens_in"])
    assert all(a < b < c for a, b, c in by_session.values())


def test_a_hanging_server_is_counted_not_waited_for(hanging: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    code, doc = _bench(
        hanging, tmp_path, "--rate", "inf", "--num-requests", "4", "--timeout", "0.5"
    )
    assert time.monotonic() - t0 < 15
    assert code == 0
    s = doc["runs"][0]["summary"]
    assert s["num_ok"] == 0 and s["errors"] == {"timeout after 0.5 s": 4}
    assert s["ttft_p50_ms"] is None and s["goodput_per_s"] == 0


def test_refused_requests_are_errors(server: ServerThread, tmp_path: Path) -> None:
    code, doc = _bench(server.base_url, tmp_path, "--num-requests", "2", "--model", "nope")
    assert code == 0
    assert doc["runs"][0]["summary"]["errors"] == {"http 404": 2}


def test_not_loopback_needs_allow_remote(tmp_path: Path, capsys: Any) -> None:
    code, _ = _bench("http://192.0.2.1:8000", tmp_path, "--num-requests", "1")
    assert code == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_debug_steps_shows_the_gaps(server: ServerThread) -> None:
    import httpx

    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).raise_for_status()
    doc = httpx.get(f"{server.base_url}/debug/steps?last=5", timeout=30).json()
    assert doc["summary"]["num_steps"] == len(doc["steps"]) == 5
    assert all(s["duration_ms"] > 0 for s in doc["steps"])
    assert any(s["gap_ms"] is not None for s in doc["steps"])


def test_fit_calibrates_the_simulator(server: ServerThread, tmp_path: Path) -> None:
    code, doc = _bench(
        server.base_url, tmp_path, "--trace", "chat", "--scale", "32", "--rate", "50",
        "--num-requests", "12", "--fit",
    )  # fmt: skip
    assert code == 0
    fit = doc["runs"][0]["fit"]
    assert fit["num_steps"] >= 3
    assert all(v >= 0 for v in fit["cost_ms"].values())
    assert fit["cost_ms"]["a"] + fit["cost_ms"]["c"] + fit["cost_ms"]["f"] > 0  # steps cost
    assert [t["name"] for t in fit["terms"]] == ["a", "f", "b", "c", "gap"]
    assert all(t["stderr_ms"] is not None for t in fit["terms"])
    assert fit["replicas"] == 1 and fit["noise_factors"]
    # Every request was matched to the server's checkpoints (the bench's X-Request-Id).
    assert all(o["num_requests"] == 12 for o in fit["overheads"])
    metrics = [c["metric"] for c in fit["comparisons"]]
    assert metrics == [
        "TTFT P50", "TTFT P90", "TTFT P99", "TBT P50", "TBT P90", "TBT P99", "goodput",
    ]  # fmt: skip
    assert all(c["simulated"] is not None and c["simulated"] > 0 for c in fit["comparisons"])


def test_debug_requests_names_the_clients_requests(server: ServerThread) -> None:
    import httpx

    base = server.base_url
    since = httpx.get(f"{base}/debug/requests", timeout=30).json()["last_index"] + 1
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", f"{base}/v1/completions", json=body, headers={"X-Request-Id": "mine"}, timeout=30
    ) as r:
        r.read()
    (t,) = httpx.get(f"{base}/debug/requests?since={since}", timeout=30).json()["requests"]
    assert t["client_id"] == "mine"
    assert t["received_s"] <= t["queued_s"] <= t["added_s"] <= t["first_output_s"]
    assert t["engine_ttft_ms"] > 0 and len(t["engine_token_ms"]) == 4


def test_fit_needs_the_step_records(hanging: str, tmp_path: Path, capsys: Any) -> None:
    code, _ = _bench(hanging, tmp_path, "--num-requests", "1", "--fit")
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "per-step records" in err and "Traceback" not in err
