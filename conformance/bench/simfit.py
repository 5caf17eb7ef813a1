"""The simulator against the server it was fitted to: ``refserve serve`` with 1 and with
N replicas, each loaded by ``bench-serve --fit`` on the same trace and rate, in one run.

Run::

    python -m refserve.conformance.bench.simfit --json out/bench-simfit.json \\
        [--replicas 1,2] [--rate 4] [--duration 60] [--model tiny-trained]

For each replica count it starts ``refserve serve --model M --replicas N`` on a free
loopback port (a process of its own, as an operator would), waits for ``/health``, runs
``bench-serve --trace chat --rate R --duration D --fit`` against it in this process,
and stops it. The JSON keeps each run's summary and fit (the per-request records stay
out: they are thousands of lines); docs/BENCHMARKS.md renders it
(conformance/bench/report.py). A server that does not come up, or a fit that fails, ends
the run with exit 1 and one line saying which.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from refserve.conformance.bench.machine import Provenance

FORMAT = "refserve-bench-simfit"
#: The figures the target holds to (relative error of the simulator).
TARGET = 0.15
TARGET_METRICS = ("TTFT P50", "TTFT P90", "TBT P50", "TBT P90", "goodput")
_CLI = "import sys; from refserve.cli.main import main; sys.exit(main(sys.argv[1:]))"
START_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_up(base: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it served")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {START_TIMEOUT_S:g} s")


def measure(replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    """One server with ``replicas`` replicas, loaded and fitted; its summary and fit."""
    from refserve.cli.main import main as cli

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-c", _CLI, "serve", "--model", args.model, "--port", str(port)]
    serve += ["--replicas", str(replicas)]
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_up(base, proc)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.json"
            code = cli(
                [
                    "bench-serve", "--base-url", base, "--model", args.model,
                    "--trace", args.trace, "--rate", str(args.rate),
                    "--duration", str(args.duration), "--seed", str(args.seed),
                    "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
                    "--fit", "--no-progress", "--json", str(out),
                ]
            )  # fmt: skip
            if code != 0 or not out.exists():
                raise RuntimeError(f"bench-serve --fit exited {code}")
            (run,) = json.loads(out.read_text(encoding="utf-8"))["runs"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"replicas": replicas, "summary": run["summary"], "fit": run["fit"]}


# --------------------------------------------------------------------- rendering
def _ms(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _err(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def table(doc: dict[str, Any]) -> list[str]:
    """The section's body: the comparison per replica count, then each fit's model."""
    w = doc["workload"]
    runs = doc["runs"]
    head = "| metric | " + " | ".join(
        f"{r['replicas']} replica{'s' if r['replicas'] > 1 else ''}: measured (90 % interval)"
        " / simulated / error"
        for r in runs
    )
    lines = [
        f"Trace `{w['trace']}` at {w['rate']:g} requests/s for {w['duration_s']:g} s "
        f"(seed {w['seed']}), model `{w['model']}`; goodput under TTFT <= "
        f"{w['slo_ttft_ms']:g} ms and TPOT <= {w['slo_tpot_ms']:g} ms. The target: "
        f"|error| <= {TARGET:.0%} on {', '.join(TARGET_METRICS)}.",
        "",
        head + " |",
        "|---|" + "---:|" * len(runs),
    ]
    by_metric: dict[str, list[str]] = {}
    for r in runs:
        for c in r["fit"]["comparisons"]:
            fmt = ".1f" if c["unit"] == "ms" else ".2f"
            cell = (
                f"{_ms(c['measured'], fmt)} ({_ms(c['measured_lo'], fmt)}-"
                f"{_ms(c['measured_hi'], fmt)}) / {_ms(c['simulated'], fmt)} / {_err(c['error'])}"
            )
            by_metric.setdefault(f"{c['metric']} ({c['unit']})", []).append(cell)
    lines += [f"| {m} | " + " | ".join(cells) + " |" for m, cells in by_metric.items()]
    lines.append("")
    for r in runs:
        f, s = r["fit"], r["summary"]
        terms = ", ".join(
            f"{t['name']} {t['value_ms']:.3f} ± {_ms(t['stderr_ms'], '.3f')}"
            + ("" if t["r2_drop"] is None else f" (R1 -{t['r2_drop']:.3f} without)")
            for t in f["terms"]
        )
        over = ", ".join(
            f"{o['name']} {_ms(o['p50_ms'], '.2f')}/{_ms(o['p90_ms'], '.2f')}"
            for o in f["overheads"]
        )
        router = f", router {f['router']}" if f.get("router") else ""
        lines += [
            f"- {r['replicas']} replica(s){router}: {s['num_ok']} of {s['num_requests']} "
            f"requests ok over {s['duration_s']:.1f} s; {f['num_steps']} steps fitted, "
            f"R1 {f['r_squared']:.3f}; terms (ms): {terms}; per request P50/P90 (ms): {over}.",
        ]
    return [*lines, ""]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refserve.conformance.bench.simfit")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--replicas", default="1,2", help="replica counts (default %(default)s)")
    p.add_argument("--model", default="tiny-trained")
    p.add_argument("--trace", default="chat")
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    args = p.parse_args(argv)
    try:
        counts = [int(x) for x in args.replicas.split(",") if x.strip()]
    except ValueError:
        p.error(f"--replicas: comma-separated counts, got {args.replicas!r}")
    if not counts or any(n < 1 for n in counts):
        p.error("--replicas: every count must be >= 1")
    provenance = Provenance.start(
        "python -m refserve.conformance.bench.simfit "
        + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    )
    runs = []
    for n in counts:
        try:
            runs.append(measure(n, args))
        except RuntimeError as e:
            print(f"simfit: {n} replica(s): {e}", file=sys.stderr)
            return 1
    doc = {
        **provenance.header(FORMAT),
        "workload": {
            "model": args.model,
            "trace": args.trace,
            "rate": args.rate,
            "duration_s": args.duration,
            "seed": args.seed,
            "slo_ttft_ms": args.slo_ttft_ms,
            "slo_tpot_ms": args.slo_tpot_ms,
        },
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print("\n".join(table(doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
