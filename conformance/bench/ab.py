"""Two checkouts of refserve, one pytest-benchmark suite, rounds interleaved: the before /
after figure of a change (docs/BENCHMARKS.md, "Before and after a change").

A figure measured on a shared machine moves with the load more than with most changes,
so a before/after comparison is only worth its ratio when both sides ran in the same
session, alternating: each round runs the suite once in the base checkout and once in
the new one (the order alternating between rounds), and the ratio is taken of the
medians over rounds of each benchmark's own median. Each checkout runs its own code: one
with the one import name (docs/ARCHITECTURE.md, "One import name") through its link tree,
which its own ``make tree`` writes and ``PYTHONPATH`` puts first; an older one, whose
folders were the import names, through the working directory that ``python -m pytest``
puts first.

    python -m refserve.conformance.bench.ab --base ../refserve-before --new . --rounds 3 \\
        --json out/ab.json --markdown out/ab.md -- tests/bench/test_step_bench.py

Exit 0 with both sides measured, 2 when a side could not run (its pytest output is
printed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refserve.conformance.bench.machine import Provenance, machine_line

SIDES = ("base", "new")
FORMAT = "refserve-bench-ab"


@dataclass(frozen=True)
class Figure:
    """One benchmark's medians (seconds) per round, for each side."""

    name: str
    base: tuple[float, ...]
    new: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """new / base of the medians over rounds: above 1 is slower."""
        return statistics.median(self.new) / statistics.median(self.base)


def own_code(checkout: Path) -> dict[str, str]:
    """The environment in which ``checkout``'s own code is the one imported (module doc)."""
    makefile = checkout / "Makefile"
    env = dict(os.environ)
    if makefile.is_file() and re.search(r"^tree:", makefile.read_text(encoding="utf-8"), re.M):
        done = subprocess.run(
            ["make", "-C", str(checkout), "tree"], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{checkout}: make tree exited {done.returncode}\n{done.stderr}")
        env["PYTHONPATH"] = str(checkout / "build" / "tree")
    return env


def run_suite(
    checkout: Path, tests: list[str], out: Path, env: dict[str, str] | None = None
) -> dict[str, float]:
    """Each benchmark's median (s) from one pytest-benchmark run in ``checkout``."""
    cmd = [
        sys.executable, "-m", "pytest", *tests, "--benchmark-only", "-q",
        "-p", "no:cacheprovider", f"--benchmark-json={out}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{checkout}: pytest exited {done.returncode}\n{done.stdout[-3000:]}")
    data = json.loads(out.read_text(encoding="utf-8"))
    return {b["fullname"]: float(b["stats"]["median"]) for b in data["benchmarks"]}


def commit_of(checkout: Path) -> str:
    """The checkout's git commit (``+`` if its tree has changes), or ``unknown``."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(checkout), *args], capture_output=True, text=True, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return (head + ("+" if dirty else "")) if head else "unknown"


def interleave(base: Path, new: Path, tests: list[str], rounds: int) -> list[Figure]:
    per_side: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    envs = {"base": own_code(base), "new": own_code(new)}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            for side in order:
                checkout = base if side == "base" else new
                out = Path(tmp) / f"{side}-{i}.json"
                per_side[side].append(run_suite(checkout, tests, out, envs[side]))
    common = sorted(set.intersection(*(set(r) for runs in per_side.values() for r in runs)))
    return [
        Figure(
            name,
            tuple(r[name] for r in per_side["base"]),
            tuple(r[name] for r in per_side["new"]),
        )
        for name in common
    ]


def to_markdown(figures: list[Figure], record: dict[str, Any]) -> str:
    lines = [
        f"Command: `{record['command']}`, with BASE a checkout of "
        f"`{record.get('base_commit', 'unknown')}` and NEW of "
        f"`{record.get('new_commit', 'unknown')}`.  ",
        f"{machine_line(record['machine'])}; load after: {record['load_after']}",
        "",
        "| benchmark | base median | new median | new / base |",
        "|---|---:|---:|---:|",
    ]
    for f in figures:
        b, n = statistics.median(f.base), statistics.median(f.new)
        lines.append(f"| `{f.name}` | {b * 1e6:.1f} us | {n * 1e6:.1f} us | {f.ratio:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m refserve.conformance.bench.ab",
        description="A pytest-benchmark suite in two checkouts, rounds interleaved.",
    )
    parser.add_argument("--base", type=Path, required=True, help="the checkout before")
    parser.add_argument("--new", type=Path, required=True, help="the checkout after")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side (default 3)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("tests", nargs="+", help="the benchmark files, as pytest takes them")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    # The checkouts are named by commit, not by path: a path means nothing on another
    # machine, and the commit says exactly which code each side ran.
    provenance = Provenance.start(
        f"python -m refserve.conformance.bench.ab --base BASE --new NEW --rounds {args.rounds} "
        + " ".join(args.tests)
    )
    commits = {"base_commit": commit_of(args.base), "new_commit": commit_of(args.new)}
    try:
        figures = interleave(args.base.resolve(), args.new.resolve(), args.tests, args.rounds)
    except RuntimeError as e:
        print(f"ab: {e}", file=sys.stderr)
        return 2
    record: dict[str, Any] = {**provenance.header(FORMAT), **commits}
    record["figures"] = [
        {"name": f.name, "base_s": list(f.base), "new_s": list(f.new), "ratio": f.ratio}
        for f in figures
    ]
    table = to_markdown(figures, record)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table, encoding="utf-8")
    print(table, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
