"""``make bench-peers``: refserve, nano-vllm-fork and vLLM side by side, interleaved.

Run from refserve's venv::

    python -m refserve.conformance.bench.peers --json out/bench-peers.json --markdown
    out/bench-peers.md

Each engine runs in a worker process started with its own venv's Python (refserve: this
interpreter; nano-vllm-fork: ``.venv-nanovllm``; vLLM: ``.venv-vllm``), built by
``make conformance-nanovllm`` / ``make conformance-vllm``. Every worker first builds
every configuration of :mod:`refserve.conformance.bench.workload` (N requests prefilled and
decoding, prefix caching off and on). Then the rounds interleave the engines: in each
round, for each configuration, each engine times one decode step, the engines' order
rotating from round to round, so that a slow phase of the machine hits every engine
alike. A cell's figure is the median over the rounds of the step time divided by N (us
per running request); its ratio is that median over refserve's for the same
configuration in the same run, and its growth is the figure at the largest N over the
figure at the smallest.

The block-pool part (``--only pool`` runs it alone) times each engine's block pool by
itself: a round allocates ``POOL_K`` = 32 fresh blocks for a new request and frees them,
with prefix caching off and on (on: every full block hashed, sha256 over the same 160
bytes in both engines, and indexed; every pop evicts a cached block), plus vLLM with its
own hashing. Rounds interleave as for the steps (``POOL_REPS`` timed rounds per message);
a cell's figure is the median over all its rounds per block, its ratio that over
refserve's with caching as configured, in the same run.

Every worker runs on one CPU (``--cpu``, default the highest-numbered; ``--no-pin`` lets
the OS place them): see :func:`pinned`.

A missing venv, an engine that cannot be imported, a worker that dies or hangs are
reported in the table and on stderr in one line each (exit 1), never as a traceback;
the other engines' figures are still written.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import selectors
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from refserve.conformance.bench import workload as W
from refserve.conformance.bench.machine import describe
from refserve.conformance.bench.render import render_markdown
from refserve.conformance.bench.results import BASELINE, POOL_CONFIGS, Cell, PoolCell, Run

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class EngineSpec:
    """Where one engine's worker runs."""

    key: str
    module: str
    venv: str | None
    """The venv directory under the repository root (None: this interpreter)."""
    build: str
    """How to build that venv."""
    args: tuple[str, ...] = ()
    """Arguments for the worker module."""


ENGINES: dict[str, EngineSpec] = {
    "ref": EngineSpec("ref", "refserve.conformance.bench.ref_worker", None, "make venv"),
    # refserve's own baseline: the same worker on the per-request reference loop.
    "ref-loop": EngineSpec(
        "ref-loop",
        "refserve.conformance.bench.ref_worker",
        None,
        "make venv",
        ("--reference-loop",),
    ),
    "nanovllm": EngineSpec(
        "nanovllm",
        "refserve.conformance.bench.nanovllm_worker",
        ".venv-nanovllm",
        "make conformance-nanovllm",
    ),
    "vllm": EngineSpec(
        "vllm", "refserve.conformance.bench.vllm_worker", ".venv-vllm", "make conformance-vllm"
    ),
}
SETUP_TIMEOUT = 600.0
STEP_TIMEOUT = 120.0


class WorkerError(Exception):
    """A worker that is missing, died, hung or answered nonsense (one line)."""


class Worker:
    """One engine's worker process and its line protocol (refserve.conformance.bench.worker)."""

    def __init__(self, spec: EngineSpec, python: str) -> None:
        self.spec = spec
        self.python = python
        self.proc: subprocess.Popen[str] | None = None
        self.stderr: IO[str] | None = None
        self.hello: dict[str, Any] = {}

    def start(self, timeout: float) -> dict[str, Any]:
        if not Path(self.python).is_file():
            raise WorkerError(
                f"not run: {self.python} not found (build the venv: {self.spec.build})"
            )
        env = dict(os.environ)
        # Closed by stop(); it outlives this method (the worker writes to it).
        self.stderr = tempfile.TemporaryFile(  # noqa: SIM115
            "w+", encoding="utf-8", errors="replace"
        )
        try:
            self.proc = subprocess.Popen(
                # -P: the working directory (the checkout, whose kernels/ and spec/ folders
                # would hide installed distributions of those names) is not put on sys.path;
                # each venv runs the refserve installed in it (the Makefile installs the wheel).
                [self.python, "-P", "-m", self.spec.module, *self.spec.args],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.stderr,
                text=True,
                encoding="utf-8",
            )
        except OSError as e:
            raise WorkerError(f"not run: cannot start {self.python}: {e}") from e
        hello = self._read(timeout)
        if not hello.get("ok"):
            raise WorkerError(f"cannot start: {hello.get('error', hello)}")
        self.hello = hello
        return hello

    def ask(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        proc = self.proc
        if proc is None or proc.stdin is None:
            raise WorkerError("worker not started")
        try:
            proc.stdin.write(json.dumps(msg) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerError(f"worker died ({e}){self._stderr_tail()}") from e
        return self._read(timeout)

    def _read(self, timeout: float) -> dict[str, Any]:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.kill()
                raise WorkerError(f"no answer within {timeout:.0f} s (killed)")
        line = proc.stdout.readline()
        if not line:
            code = proc.wait(timeout=10)
            raise WorkerError(f"worker exited with status {code}{self._stderr_tail()}")
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            raise WorkerError(f"not a protocol line: {line.strip()[:200]!r}") from None
        if not isinstance(msg, dict):
            raise WorkerError(f"not a protocol object: {line.strip()[:200]!r}")
        return msg

    def _stderr_tail(self) -> str:
        if self.stderr is None:
            return ""
        self.stderr.seek(0)
        lines = [ln.strip() for ln in self.stderr.read().splitlines() if ln.strip()]
        return f": {lines[-1][:300]}" if lines else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                if proc.stdin is not None:
                    proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                    proc.stdin.flush()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                proc.kill()
                proc.wait()
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None


# --------------------------------------------------------------------- the run
def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


@contextmanager
def pinned(cpu: int | None) -> Iterator[int | None]:
    """Run the body on CPU ``cpu`` alone, and so every process it starts (they inherit
    the affinity); the CPU, or None when ``cpu`` is None or the platform cannot pin.

    Unpinned on a shared 2-CPU VM, the OS moves a worker between the CPUs mid-run, and a
    run's figure moves with it: two ``--no-pin`` runs of ``--only pool`` a minute apart
    gave vLLM/refserve 1.20x and 0.80x without caching, three pinned runs beside them
    1.06x-1.11x (docs/GUIDE.md, "Benchmarks"). The rounds run one at a time, so pinned workers
    never wait for each other; each still finds the caches as the other engines' rounds
    left them."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


def default_cpu() -> int | None:
    """The highest-numbered CPU this process may run on (None without CPU affinity)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return max(os.sched_getaffinity(0))


def run_peers(
    engines: Sequence[str],
    pythons: dict[str, str],
    sizes: Sequence[int],
    rounds: int,
    warmup: int,
    command: str,
    log: IO[str] | None = None,
    parts: Sequence[str] = ("steps", "pool"),
) -> Run:
    """Start one worker per engine, build every configuration, interleave the rounds.
    The workers run where this process may (:func:`pinned` narrows that)."""
    log = sys.stderr if log is None else log
    shapes = W.shapes(tuple(sizes)) if "steps" in parts else []
    run = Run(
        command=command,
        sizes=list(sizes),
        rounds=rounds,
        warmup=warmup,
        engines={},
        cells=[],
        started=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        load_before=_load(),
        machine=describe(),
        cpus=os.cpu_count() or 0,
        parts=tuple(parts),
    )
    pool_configs = POOL_CONFIGS if "pool" in parts else ()
    workers: dict[str, Worker] = {}
    try:
        for e in engines:
            spec = ENGINES[e]
            w = Worker(spec, pythons[e])
            info: dict[str, Any] = {"name": e, "python_path": pythons[e]}
            run.engines[e] = info
            try:
                hello = w.start(SETUP_TIMEOUT)
            except WorkerError as err:
                info["error"] = str(err)
                print(f"bench-peers: {e}: {err}", file=log)
                w.stop()
                for s in shapes:
                    run.cells.append(Cell(e, s.n, s.prefix_caching, "error", str(err)))
                for caching, hashing in pool_configs:
                    run.pool_cells.append(
                        PoolCell(e, W.POOL_K, caching, "error", str(err), hashing=hashing)
                    )
                continue
            info.update(
                name=hello.get("engine", e),
                includes=hello.get("includes", ""),
                phases=list(hello.get("phases", [])),
                python=hello.get("python", ""),
                pool_includes=hello.get("pool_includes", ""),
                cpus=list(hello.get("cpus", [])),
            )
            workers[e] = w
        # The pool first, on fresh workers: measured after the steps, vLLM's pool took
        # 0.71 us per block in one run against 0.46 us in a pool-only run.
        for caching, hashing in pool_configs:
            _measure_pool(caching, hashing, workers, run, rounds, warmup, log)
        for s in shapes:
            _measure(s, workers, run, rounds, warmup, log)
    finally:
        for w in workers.values():
            w.stop()
        run.load_after = _load()
    return run


def _measure(
    s: W.Shape, workers: dict[str, Worker], run: Run, rounds: int, warmup: int, log: IO[str]
) -> None:
    """One configuration: built in every worker, the rounds interleaved, then dropped (a
    worker holds one configuration at a time, so no engine's heap carries the others)."""
    cells: dict[str, Cell] = {}
    for e, w in workers.items():
        cell = Cell(e, s.n, s.prefix_caching)
        cells[e] = cell
        run.cells.append(cell)
        print(f"bench-peers: {e}: building {s.key}", file=log)
        _ask_into(cell, w, {"cmd": "setup", "n": s.n, "prefix_caching": s.prefix_caching})
        if cell.status == "error":
            print(f"bench-peers: {e}: {s.key}: {cell.reason}", file=log)
    order = [e for e in workers if cells[e].status == "ok"]
    for r in range(warmup + rounds if order else 0):
        k = r % len(order)
        for e in order[k:] + order[:k]:  # the engines' order rotates from round to round
            cell = cells[e]
            if cell.status != "ok":
                continue
            ans = _ask_into(cell, workers[e], {"cmd": "steps", "key": s.key, "steps": 1})
            if cell.status == "error":
                print(f"bench-peers: {e}: {s.key}: {cell.reason}", file=log)
            elif r >= warmup and ans is not None:
                cell.times_ns.extend(ans["times_ns"])
    for e in order:
        if cells[e].status == "ok":
            _ask_into(cells[e], workers[e], {"cmd": "drop", "key": s.key})
    if order:
        print(f"bench-peers: {s.key}: {rounds} rounds done", file=log)


def _measure_pool(
    caching: bool,
    hashing: str,
    workers: dict[str, Worker],
    run: Run,
    rounds: int,
    warmup: int,
    log: IO[str],
) -> None:
    """One block-pool configuration, as :func:`_measure` does a step configuration."""
    key = W.pool_key(caching, hashing)
    cells: dict[str, PoolCell] = {}
    for e, w in workers.items():
        cell = PoolCell(e, W.POOL_K, caching, hashing=hashing)
        cells[e] = cell
        run.pool_cells.append(cell)
        setup = {"cmd": "pool_setup", "prefix_caching": caching, "hashing": hashing}
        _ask_into(cell, w, setup)
        if cell.status == "error":
            print(f"bench-peers: {e}: {key}: {cell.reason}", file=log)
    order = [e for e in workers if cells[e].status == "ok"]
    for r in range(warmup + rounds if order else 0):
        k = r % len(order)
        for e in order[k:] + order[:k]:
            cell = cells[e]
            if cell.status != "ok":
                continue
            msg = {"cmd": "pool_rounds", "key": key, "rounds": W.POOL_REPS}
            ans = _ask_into(cell, workers[e], msg)
            if cell.status == "error":
                print(f"bench-peers: {e}: {key}: {cell.reason}", file=log)
            elif r >= warmup and ans is not None:
                cell.times_ns.extend(ans["times_ns"])
    for e in order:
        if cells[e].status == "ok":
            _ask_into(cells[e], workers[e], {"cmd": "drop", "key": key})
    if order:
        print(f"bench-peers: {key}: {rounds} rounds done", file=log)


def _ask_into(cell: Cell, w: Worker, msg: dict[str, Any]) -> dict[str, Any] | None:
    """Ask the worker; an unsupported configuration or a failure is recorded in the cell."""
    timed = msg["cmd"] in ("steps", "pool_rounds")
    timeout = STEP_TIMEOUT if timed else SETUP_TIMEOUT
    try:
        ans = w.ask(msg, timeout)
    except WorkerError as err:
        cell.status, cell.reason = "error", str(err)
        return None
    if ans.get("unsupported"):
        cell.status, cell.reason = "unsupported", str(ans["unsupported"])
        return None
    if not ans.get("ok"):
        cell.status, cell.reason = "error", str(ans.get("error", ans))
        return None
    if msg["cmd"] == "setup":
        cell.setup_s = float(ans.get("setup_s", 0.0))
    elif timed and not isinstance(ans.get("times_ns"), list):
        cell.status, cell.reason = "error", "answer without times_ns"
        return None
    return ans


def default_python(spec: EngineSpec) -> str:
    if spec.venv is None:
        return sys.executable
    return str(ROOT / spec.venv / "bin" / "python")


@dataclass(frozen=True)
class Options:
    """A checked command line: what one run measures, on which CPU, and where it writes."""

    engines: tuple[str, ...]
    """As asked, each once; refserve put first when not asked for (every ratio needs it
    in the same run)."""
    pythons: dict[str, str]
    sizes: tuple[int, ...]
    rounds: int
    warmup: int
    parts: tuple[str, ...]
    cpu: int | None
    """The one CPU of every worker (None: the OS places them)."""
    command: str
    """The command line, as the JSON and the markdown record it."""
    json: Path
    markdown: Path


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_options(argv)
    with pinned(opts.cpu) as on:
        run = run_peers(
            opts.engines,
            opts.pythons,
            opts.sizes,
            opts.rounds,
            opts.warmup,
            opts.command,
            parts=opts.parts,
        )
    run.pinned_cpu = on
    _write(run, opts.json, opts.markdown)
    failed = [c for c in [*run.cells, *run.pool_cells] if c.status == "error"]
    return 1 if failed else 0


def parse_options(argv: Sequence[str] | None) -> Options:
    """The command line, checked: a bad value exits 2 through argparse, naming it."""
    p = _parser()
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or any(n < 1 for n in args.sizes):
        p.error("--rounds must be >= 1, --warmup >= 0 and every size >= 1")
    cpu = None if args.no_pin else args.cpu
    _check_cpu(p, cpu)
    pythons = _pythons(p, args.python)
    engines = list(dict.fromkeys(args.engines))
    if BASELINE not in engines:
        engines.insert(0, BASELINE)
    command = "python -m refserve.conformance.bench.peers " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    return Options(
        engines=tuple(engines),
        pythons=pythons,
        sizes=tuple(sorted(set(args.sizes))),
        rounds=args.rounds,
        warmup=args.warmup,
        parts=(args.only,) if args.only else ("steps", "pool"),
        cpu=cpu,
        command=command,
        json=args.json,
        markdown=args.markdown,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m refserve.conformance.bench.peers",
        description="refserve, nano-vllm-fork and vLLM scheduler steps side by side.",
    )
    p.add_argument(
        "--engines",
        nargs="+",
        choices=sorted(ENGINES),
        default=["ref", "nanovllm", "vllm"],
        help="ref-loop (refserve on its reference loop) is refserve's own baseline, used by "
        "`make bench`",
    )
    p.add_argument("--sizes", nargs="+", type=int, default=list(W.SIZES), metavar="N")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--only",
        choices=("steps", "pool"),
        help="run only the scheduler steps or only the block pool (default: both)",
    )
    p.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="ENGINE=PATH",
        help="the interpreter of an engine's worker (default: its venv's)",
    )
    pin = p.add_mutually_exclusive_group()
    pin.add_argument(
        "--cpu",
        type=int,
        default=default_cpu(),
        help="the CPU every worker runs on (default: the highest-numbered one allowed)",
    )
    pin.add_argument(
        "--no-pin", action="store_true", help="let the OS place the workers on any CPU"
    )
    p.add_argument("--json", type=Path, default=ROOT / "out" / "bench-peers.json")
    p.add_argument("--markdown", type=Path, default=ROOT / "out" / "bench-peers.md")
    return p


def _check_cpu(p: argparse.ArgumentParser, cpu: int | None) -> None:
    # Refused here, by name: os.sched_setaffinity in pinned() would only say EINVAL.
    if cpu is not None and hasattr(os, "sched_getaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        if cpu not in allowed:
            p.error(f"--cpu {cpu}: this process may run on CPUs {allowed} only")


def _pythons(p: argparse.ArgumentParser, items: Sequence[str]) -> dict[str, str]:
    """Every engine's worker interpreter: its venv's, or ``--python ENGINE=PATH``."""
    pythons = {e: default_python(s) for e, s in ENGINES.items()}
    for item in items:
        e, sep, path = str(item).partition("=")
        if not sep or e not in ENGINES or not path:
            p.error(f"--python takes ENGINE=PATH with ENGINE one of {sorted(ENGINES)}")
        pythons[e] = path
    return pythons


def _write(run: Run, json_path: Path, markdown_path: Path) -> None:
    """The run's JSON and its markdown, which also goes to stdout."""
    for path in (json_path, markdown_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(run.to_json(), indent=1) + "\n", encoding="utf-8")
    md = render_markdown(run)
    markdown_path.write_text(md, encoding="utf-8")
    print(md)


if __name__ == "__main__":
    raise SystemExit(main())
