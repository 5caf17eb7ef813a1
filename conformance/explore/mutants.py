"""The explorer against mutmut's mutants (docs/CONFORMANCE.md, "Against mutants").

mutmut 3 writes every mutant of the files ``[tool.mutmut] only_mutate`` names into a copy
of the tree under ``mutants/``, each function behind a trampoline that calls the mutant
named by the environment variable ``MUTANT_UNDER_TEST`` (``module.mangled__mutmut_N``)
and the original otherwise. This driver runs, from that directory, the exhaustive
explorer (:func:`refserve.conformance.explore.explore`, ``copy`` strategy, first counterexample
only) in a fresh subprocess per mutant and adapter with the variable set, under a
wall-clock limit, and writes one JSON line per mutant::

    cd build/tree/mutants && ../../../.venv/bin/python -m refserve.conformance.explore.mutants \\
        --survivors-of ../../../docs/mutation/*.json --out ../../../explore-survivors.jsonl

A counterexample, a timeout, a crash or a scope the mutant made unsupported or
unexhaustible kills the mutant (as mutmut counts a timeout). ``--reached`` first runs the
explorer once per adapter with ``MUTANT_UNDER_TEST=stats`` (mutmut's trampolines then
record every function called): a mutant of a function the explorer never calls is
``not_reached`` without a run. The swap adapter runs only for mutants of ``host_pool.py``
and ``suspend.py``, of functions named for swapping, and of functions that only the swap
adapter reaches; every other mutant runs on the recompute adapter alone.

The mutants are generated without mutmut's test pass by ``--generate`` (mutmut's own
copy and mutation steps, run from the link tree ``build/tree`` that ``make tree`` writes).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ADAPTERS = {"ref": "make", "swap": "make_swap"}
SUFFIX = re.compile(r"__mutmut_\d+$")
SWAP_MODULES = ("refserve.kv.host_pool.", "refserve.core.suspend.")


def function_of(mutant: str) -> str:
    """``refserve.core.scheduler.xǁSchedulerǁ_plan__mutmut_91`` -> ``...xǁSchedulerǁ_plan``."""
    return SUFFIX.sub("", mutant)


def all_mutants(root: Path) -> list[str]:
    """Every mutant name mutmut generated under ``root`` (the ``mutants/`` directory)."""
    names: list[str] = []
    for meta in sorted(root.glob("refserve/**/*.py.meta")):
        names.extend(json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"])
    return sorted(names)


def read_names(path: Path) -> list[str]:
    """Mutant names, one a line; ``#`` starts a comment."""
    out: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            out.append(name)
    return out


def survivors_of(runs: Sequence[Path]) -> list[str]:
    """The named survivors of mutation runs (docs/mutation/*.json) still surviving: not
    killed since by a test, nor gone with removed code."""
    from refserve.conformance.mutation.results import load

    gone = ("killed-since", "removed")
    names = [s.name for _, r in load(runs) for s in r.survivors if s.verdict not in gone]
    return list(dict.fromkeys(names))  # a mutant may survive in more than one run


def generate() -> None:
    """mutmut's generation steps alone (copy the tree, write every mutant): no clean
    test run, no statistics, no mutant run. Run from the link tree (``make tree``)."""
    main: Any = importlib.import_module("mutmut.__main__")
    tramp: Any = importlib.import_module("mutmut.mutation.trampoline")
    files: Any = importlib.import_module("mutmut.utils.file_utils")
    tramp.set_mutant_under_test("mutant_generation")
    os.makedirs("mutants", exist_ok=True)
    files.copy_src_dir()
    files.copy_also_copy_files()
    files.setup_source_paths()
    print(main.create_mutants(1))


# ---------------------------------------------------------------- in the child process
def explore_once(adapter: str, scope: str) -> dict[str, Any]:
    """One exploration on the engine as ``MUTANT_UNDER_TEST`` makes it."""
    import refserve.conformance.adapters.ref as ref_adapters
    from refserve.conformance.explore import SCOPES, explore

    factory = getattr(ref_adapters, ADAPTERS[adapter])
    res = explore(factory, SCOPES[scope], strategy="copy", first_only=True)
    out: dict[str, Any] = {
        "states": res.states,
        "transitions": res.transitions,
        "exhausted": res.exhausted,
        "seconds": round(res.seconds, 2),
    }
    if res.counterexamples:
        c = res.counterexamples[0]
        out.update(
            how="counterexample",
            kind=c.kind,
            invariant=str(c.finding.invariant),
            finding=str(c.finding),
            path=[str(e) for e in c.path + c.cycle],
        )
    elif res.not_supported:
        out.update(how="not_supported", finding=res.not_supported)
    elif not res.exhausted:
        out.update(how="not_exhausted", finding="the scope was not exhausted")
    return out


def reached(adapter: str, scope: str) -> list[str]:
    """The mutated functions one exploration calls (mutmut's ``stats`` trampolines)."""
    os.environ["MUTANT_UNDER_TEST"] = "stats"
    explore_once(adapter, scope)
    state: Any = importlib.import_module("mutmut.state")
    return sorted(state.state()._stats)


# ---------------------------------------------------------------- in the parent process
def child_command(flag: str, adapter: str, scope: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "refserve.conformance.explore.mutants",
        flag,
        adapter,
        "--scope",
        scope,
    ]


def run_child(mutant: str, adapter: str, scope: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, MUTANT_UNDER_TEST=mutant)
    cmd = child_command("--child", adapter, scope)
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"how": "timeout", "finding": f"no verdict within {timeout:g} s"}
    wall = round(time.perf_counter() - start, 2)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"how": "crash", "finding": f"exit {p.returncode}: {tail}", "wall": wall}
    out: dict[str, Any] = json.loads(lines[-1])
    out["wall"] = wall
    return out


def adapters_for(mutant: str, hit: dict[str, set[str]]) -> list[str]:
    fn = function_of(mutant)
    chosen = ["ref"] if fn in hit["ref"] else []
    swap_related = fn.startswith(SWAP_MODULES) or "swap" in fn.rsplit("ǁ", 1)[-1].lower()
    if fn in hit["swap"] and (swap_related or fn not in hit["ref"]):
        chosen.append("swap")
    return chosen


def verdict(
    mutant: str, hit: dict[str, set[str]], scope: str, timeout: float, baseline: dict[str, int]
) -> dict[str, Any]:
    runs = adapters_for(mutant, hit)
    row: dict[str, Any] = {"mutant": mutant, "adapters": runs}
    if not runs:
        row["verdict"] = "not_reached"
        return row
    for adapter in runs:
        out = run_child(mutant, adapter, scope, timeout)
        if "how" in out:
            row.update(verdict="killed", adapter=adapter, **out)
            return row
        row[f"{adapter}_states"] = out["states"]
        row[f"{adapter}_same_graph"] = (
            out["states"] == baseline[f"{adapter}_states"]
            and out["transitions"] == baseline[f"{adapter}_transitions"]
        )
        row[f"{adapter}_seconds"] = out["seconds"]
    row["verdict"] = "survived"
    return row


def load_hits(path: Path, scope: str) -> tuple[dict[str, set[str]], dict[str, int]]:
    """The functions each adapter reaches and the unmutated graph's size (cached)."""
    if not path.exists():
        data: dict[str, Any] = {}
        for adapter in ADAPTERS:
            p = subprocess.run(
                child_command("--child-reached", adapter, scope),
                capture_output=True,
                text=True,
                check=True,
            )
            data[adapter] = json.loads(p.stdout.strip().splitlines()[-1])
            env = {k: v for k, v in os.environ.items() if k != "MUTANT_UNDER_TEST"}
            q = subprocess.run(
                child_command("--child", adapter, scope),
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            base = json.loads(q.stdout.strip().splitlines()[-1])
            if "how" in base:
                raise SystemExit(f"the unmutated engine fails the explorer: {base}")
            data[f"{adapter}_states"] = base["states"]
            data[f"{adapter}_transitions"] = base["transitions"]
        path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    data = json.loads(path.read_text(encoding="utf-8"))
    hits = {a: set(data[a]) for a in ADAPTERS}
    base = {k: int(v) for k, v in data.items() if k not in ADAPTERS}
    return hits, base


def drive(names: Sequence[str], out: Path, hits_path: Path, scope: str, timeout: float) -> None:
    hits, baseline = load_hits(hits_path, scope)
    done = set()
    if out.exists():
        done = {json.loads(line)["mutant"] for line in out.read_text("utf-8").splitlines()}
    with out.open("a", encoding="utf-8") as f:
        for i, name in enumerate(names, 1):
            if name in done:
                continue
            start = time.perf_counter()
            row = verdict(name, hits, scope, timeout, baseline)
            row["total_s"] = round(time.perf_counter() - start, 2)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            print(f"[{i}/{len(names)}] {row['verdict']:11} {row['total_s']:6.1f}s {name}")


def select(args: argparse.Namespace, root: Path) -> list[str]:
    existing = all_mutants(root)
    if args.sample:
        # Unsorted: every prefix of the draw is itself a uniform sample (a cut-short run).
        return random.Random(args.seed).sample(existing, args.sample)
    names: list[str] = list(args.names)
    if args.names_file:
        names += read_names(Path(args.names_file))
    if args.survivors_of:
        names += survivors_of([Path(p) for p in args.survivors_of])
    have = set(existing)
    missing = [n for n in names if n not in have]
    for n in missing:
        print(f"no such mutant (renamed or gone): {n}", file=sys.stderr)
    return [n for n in dict.fromkeys(names) if n in have]


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m refserve.conformance.explore.mutants")
    ap.add_argument("names", nargs="*", help="mutant names")
    ap.add_argument("--names-file", help="a file of mutant names, one a line (# comments)")
    ap.add_argument("--survivors-of", nargs="*", help="the survivors of mutation runs' JSON")
    ap.add_argument("--sample", type=int, default=0, help="a uniform sample of every mutant")
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--scope", default="small")
    ap.add_argument("--timeout", type=float, default=120.0, help="wall seconds per run")
    ap.add_argument("--out", default="explore-mutants.jsonl")
    ap.add_argument("--hits", default="explore-hits.json", help="cache of --reached")
    ap.add_argument("--generate", action="store_true", help="write mutants/ and exit")
    ap.add_argument("--child", choices=sorted(ADAPTERS), help=argparse.SUPPRESS)
    ap.add_argument("--child-reached", choices=sorted(ADAPTERS), help=argparse.SUPPRESS)
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.generate:
        generate()
        return
    if args.child:
        print(json.dumps(explore_once(args.child, args.scope)))
        return
    if args.child_reached:
        print(json.dumps(reached(args.child_reached, args.scope)))
        return
    root = Path.cwd()
    if not (root / "refserve").is_dir() or not any(root.glob("refserve/**/*.py.meta")):
        raise SystemExit("run from mutmut's mutants/ directory (see --generate)")
    names = select(args, root)
    drive(names, Path(args.out), Path(args.hits), args.scope, args.timeout)


if __name__ == "__main__":
    main()
