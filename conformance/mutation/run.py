"""Run mutmut over the scope (every mutant, or a uniform sample) and write the run's JSON.

Run from the link tree ``build/tree`` (``make mutation`` / ``make mutation-sample`` set it
up: mutmut names a module by its path there), with mutmut installed::

    python -m refserve.conformance.mutation.run --out ../../docs/mutation/core.json \\
        --reasons ../../docs/mutation/reasons.txt --sample 150 --seed 1 \\
        --modules refserve.core refserve.kv

The scope is what ``[tool.mutmut]`` in pyproject.toml says (``only_mutate``, the test
selection), so renamed or split modules need no change here. Without ``--sample`` mutmut
runs every mutant (hours on two cores); with it, ``--sample`` mutants drawn uniformly with
``--seed`` from the modules ``--modules`` names run by name (mutmut re-runs a named mutant
even when it holds a verdict), all in one ``mutmut run`` unless ``--batch`` says how many a
run: each ``mutmut run`` first runs the tests covering its mutants once unmutated, which
for most mutants is the whole selection (minutes), and mutmut saves each verdict as it
comes, so an interrupted run loses nothing (``--collect-only`` reads what it kept).
Then the verdicts are read back from ``mutants/*.meta`` and written, with the reasons
file's verdict for each survivor, as one JSON document
(:mod:`refserve.conformance.mutation.results`).

``--resume`` runs only the drawn mutants that hold no verdict yet (mutmut resets the
verdicts of a function whose source changed, not those a new test would change).
``--collect-only`` runs nothing and writes the JSON from the verdicts mutmut already holds
(the sample drawn again from its seed); ``--refresh JSON...`` only applies the reasons
file again to committed runs, after a person has read their survivors.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from refserve.conformance.mutation import results
from refserve.errors import InputFileError

ROOT = Path(__file__).resolve().parents[2]


def shown(arg: str) -> str:
    """An argument as the recorded command shows it: a path inside the checkout relative
    to its root (the Makefile passes absolute ones), so no machine's layout is recorded."""
    path = Path(arg)
    if path.is_absolute() and path.resolve().is_relative_to(ROOT):
        return path.resolve().relative_to(ROOT).as_posix()
    return arg


def _git(*args: str) -> str | None:
    try:
        p = subprocess.run(["git", *args], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return p.stdout.strip()


def commit_measured() -> str | None:
    """The checkout's commit, marked when its working tree differs from it."""
    head = _git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return None
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + (" (with uncommitted changes)" if dirty else "")


def run_mutmut(names: Sequence[str] | None, max_children: int, batch: int) -> None:
    """``mutmut run`` over ``names`` (every mutant: None; nothing: empty), ``batch``
    names a run (all in one: 0)."""
    base = [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)]
    if names is None:
        subprocess.run(base, check=False)
        return
    batch = batch or len(names)
    for i in range(0, len(names), batch):
        print(f"run: mutants {i + 1}-{min(i + batch, len(names))} of {len(names)}", flush=True)
        subprocess.run([*base, *names[i : i + batch]], check=False)


def generate_if_missing(files: Sequence[str]) -> None:
    """mutmut's generation steps alone, when ``mutants/`` lacks a file's mutants."""
    if all(Path("mutants", f + ".meta").is_file() for f in files):
        return
    from refserve.conformance.explore.mutants import generate

    generate()


def build(args: argparse.Namespace, argv: Sequence[str]) -> results.MutationRun:
    config = results.mutmut_config(Path("pyproject.toml"))
    generate_if_missing(config.only_mutate)
    by_file = results.read_mutants(Path("mutants"), config.only_mutate)
    chosen: list[str] | None = None
    selection = results.Selection("every")
    if args.sample:
        chosen = results.draw(by_file, args.sample, args.seed, args.modules)
        selection = results.Selection("sample", args.seed, args.sample, tuple(args.modules))
    start = time.monotonic()
    if not args.collect_only:
        todo = chosen
        if args.resume and chosen is not None:
            codes = {n: c for per in by_file.values() for n, c in per.items()}
            todo = [n for n in chosen if codes[n] is None]
        run_mutmut(todo, args.max_children, args.batch)
        by_file = results.read_mutants(Path("mutants"), config.only_mutate)
    wall = None if args.collect_only else round(time.monotonic() - start, 1)
    hashes = results.read_function_hashes(Path("mutants"), config.only_mutate)
    counts, survivors, timeouts = results.collect(by_file, chosen, hashes)
    run = results.MutationRun(
        title=args.title,
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        commit=commit_measured(),
        command="python -m refserve.conformance.mutation.run " + shlex.join(map(shown, argv)),
        mutmut=_mutmut_version(),
        files=config.only_mutate,
        tests=config.tests,
        selection=selection,
        counts=counts,
        survivors=survivors,
        timeouts=timeouts,
        wall_s=wall,
        settings={**config.settings, "max_children": args.max_children},
    )
    return results.with_reasons(run, _reasons(args.reasons))


def _mutmut_version() -> str:
    try:
        return importlib.metadata.version("mutmut")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: verdicts read from an earlier run)"


def _reasons(path: str | None) -> dict[str, results.Verdict]:
    return results.read_reasons(Path(path)) if path else {}


def write(run: results.MutationRun, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(run.to_json(), indent=1, ensure_ascii=False) + "\n"
    out.write_text(text, encoding="utf-8")


def refresh(paths: Sequence[Path], reasons: dict[str, results.Verdict]) -> None:
    for name, run in results.load(paths):
        path = next(p for p in paths if p.name == name)
        write(results.with_reasons(run, reasons), path)
        print(f"run: reasons applied to {path}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m refserve.conformance.mutation.run")
    p.add_argument("--out", type=Path, help="the run's JSON (docs/mutation/NAME.json)")
    p.add_argument("--reasons", help="the reasons file (docs/mutation/reasons.txt)")
    p.add_argument("--title", default="Every mutant of the scope")
    p.add_argument("--sample", type=int, default=0, help="run a uniform sample of N mutants")
    p.add_argument("--seed", type=int, default=0, help="the sample's seed")
    p.add_argument("--modules", nargs="*", default=[], help="module prefixes to sample from")
    p.add_argument("--max-children", type=int, default=1)
    p.add_argument("--batch", type=int, default=0, help="mutants per mutmut run (0: all)")
    p.add_argument("--collect-only", action="store_true", help="run nothing, read verdicts")
    p.add_argument("--resume", action="store_true", help="run only drawn mutants not run yet")
    p.add_argument("--refresh", nargs="*", type=Path, default=None, help="runs to re-read")
    args = p.parse_args(argv)
    try:
        if args.refresh is not None:
            refresh(args.refresh, _reasons(args.reasons))
            return 0
        if args.out is None:
            p.error("--out is required")
        run = build(args, argv)
    except (InputFileError, ValueError) as e:
        print(f"run: error: {e}", file=sys.stderr)
        return 2
    write(run, args.out)
    print(f"run: wrote {args.out}")
    untriaged = [s for s in run.survivors if s.verdict == "untriaged"]
    if untriaged:
        print(f"run: {len(untriaged)} survivor(s) to read (mutmut show NAME), then give each")
        print("a line in the reasons file and apply it with --refresh:")
        for s in untriaged:
            print(f"{s.name}@{s.function_hash} VERDICT REASON")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
