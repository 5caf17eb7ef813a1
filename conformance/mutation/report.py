"""docs/MUTATION.md from the mutation runs' JSON in docs/mutation/ (never typed).

Run::

    python -m refserve.conformance.mutation.report --out docs/MUTATION.md docs/mutation/*.json

Each input is one run (:mod:`refserve.conformance.mutation.results`): what it mutated and
which tests it ran, every mutant or a uniform sample, mutmut's verdicts per file, and
every survivor with the verdict and reason a person gave it. The document has a fixed
part (how the runs are made and why the settings are what they are), the score per
package of every run (with a Wilson 95 % interval for a sample), and per run its
provenance, its counts per file and its survivors. ``make mutation-report`` renders it,
and ``tests/repo/test_mutation_doc.py`` requires the committed document to equal what the
committed JSON renders.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from refserve.conformance.mutation.results import (
    VERDICTS,
    FileCounts,
    MutationRun,
    load,
    wilson,
)
from refserve.errors import InputFileError, OutputPathError
from refserve.files import check_output_file

COMMAND = (
    "python -m refserve.conformance.mutation.report --out docs/MUTATION.md docs/mutation/*.json"
)

HOW = """\
## How the runs are made

[mutmut](https://github.com/boxed/mutmut) 3.8.1, configured in `pyproject.toml` under
`[tool.mutmut]`: `only_mutate` names the files mutated, and
`pytest_add_cli_args_test_selection` the test files run against each mutant. mutmut
writes its mutants into a copy of the package under `mutants/` (the sources are never
changed) and names a module by its file's path, so it runs in the link tree `build/tree`
(`make tree`; [ARCHITECTURE.md](ARCHITECTURE.md#one-import-name)), where
`refserve/kv/pool.py` is the module `refserve.kv.pool`. It runs only the tests that cover
the mutated function, fastest first, and stops at the first failure.

- `make mutation`: every mutant of the scope (hours on two cores), then the run's JSON
  into `docs/mutation/every.json` and this document rendered again.
- `make mutation-sample MUTATION_N=150 MUTATION_SEED=1 MUTATION_MODULES="refserve.core
  refserve.kv"`: a uniform sample of that many mutants of those modules (every module
  of the scope when none is named), run by name in one `mutmut run` (each run first runs
  the covering tests once unmutated: minutes), into `docs/mutation/sample.json`
  (`MUTATION_JSON=` names another file). Both targets run `python -m
  refserve.conformance.mutation.run` in `build/tree`, whose flags do the rest. mutmut
  saves each verdict as it comes: after an interruption, the same command with
  `--resume` runs only the drawn mutants without one. With `--batch N` the
  draw runs N at a time in its order, and every prefix of the draw is itself a uniform
  sample, so a run stopped between batches can be collected as it stands
  (`--collect-only`, which counts the rest as not run).
- `make mutation-report`: this document from `docs/mutation/*.json`, measuring nothing.
- Then, from `build/tree`: `python -m mutmut show NAME` shows one survivor's change
  (a run ends by printing a line for every survivor not read yet); after reading it,
  give it one line in `docs/mutation/reasons.txt` (`NAME@HASH VERDICT REASON`) and apply
  the file to the committed runs (`python -m refserve.conformance.mutation.run --refresh
  ../../docs/mutation/*.json --reasons ../../docs/mutation/reasons.txt`, then `make
  mutation-report`). `HASH` is mutmut's hash of the mutated function's source: mutmut
  numbers a changed function's mutants anew, so a reason tied to a hash is not applied
  to a later run in which the function changed, and that survivor is read again.

Settings, and why:

- `process_isolation = "forkserver"`: torch (which `tests/conftest.py` imports) is not
  fork-safe once its thread pools exist, and workers forked from the process that had
  run the suite sometimes deadlocked; those hangs, not infinite loops, were once counted
  as timeouts.
- Timeout per mutant (CPU seconds): (estimated test time + `timeout_constant` 3 s) x
  `timeout_multiplier` 1.0 x 2, about 100 s for the slowest functions: twice the CPU
  their covering tests need. A multiplier of 2.0 let every infinite-loop mutant burn
  about 200 s. On a loaded machine the covering tests run slower than the estimate
  mutmut measured, so a timeout is run again by name on a quiet one before it is read.
- `tests/scheduler/test_scheduler_state_machine.py` is not in the selection: it is too
  slow to run once per mutant. Changing the selection or the pytest arguments makes
  mutmut drop every cached verdict; adding a test to a selected file does not, so an old
  survivor is re-checked by name (a named mutant is always run again).
- `source_paths = ["refserve"]` must be set (mutmut 3 stops without it); the rest of the
  package is copied into `mutants/` unmutated.
- mutmut replaces each mutated function by a `functools.wraps` trampoline, so
  `Journal.record` judges an undo entry by what it wraps (`__wrapped__`); without that
  its closure check would refuse every mutated method.
- Kill tests sit beside the behaviour they pin, marked `@pytest.mark.mutation_kill`.

Reading the figures: a mutant is detected when the tests fail (killed) or run past the
time limit (timed out), as mutmut counts it; the score is detected over run. A survivor
is **equivalent** (no test can tell it from the original), **a test gap, killed since**
(a test added after the run kills it, checked by running it again by name), **not
equivalent, left** (with why), or **redundant code, removed** (the code it mutates
changed nothing and is gone). "Counting the killed since" adds the second kind to the
detected.
"""


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.1f} %" if n else "n/a"


def _interval(k: int, n: int, sample: bool) -> str:
    if not sample or not n:
        return "(every mutant)" if n else "n/a"
    lo, hi = wilson(k, n)
    return f"{100 * lo:.1f}-{100 * hi:.1f} %"


def _killed_since(run: MutationRun, label: str | None) -> int:
    """Survivors of ``label`` (every label: None) killed since the run."""
    # A record's unnamed survivors lie in its files, so in its one label when it has one.
    whole = label is None or _labels(run) == [label]
    n = sum(u.count for u in run.unnamed if u.verdict == "killed-since" and whole)
    for s in run.survivors:
        if s.verdict == "killed-since" and (label is None or _label_of(run, s.name) == label):
            n += 1
    return n


def _label_of(run: MutationRun, mutant: str) -> str | None:
    for c in run.counts:
        for f in c.files:
            if mutant.startswith(f.removesuffix(".py").replace("/", ".") + "."):
                return c.label
    return None


def _sum(label: str, counts: Sequence[FileCounts]) -> FileCounts:
    cols = ("frame", "killed", "timeout", "survived", "no_tests", "skipped", "other", "not_checked")
    total = {c: sum(getattr(x, c) for x in counts) for c in cols}
    return FileCounts(tuple(f for x in counts for f in x.files), label, **total)


def _labels(run: MutationRun) -> list[str]:
    return list(dict.fromkeys(c.label for c in _framed(run)))


def _framed(run: MutationRun) -> list[FileCounts]:
    """The files a run drew from: every file of the scope, or those of the modules a
    sample was limited to (the other files' mutants could not be drawn)."""
    modules = run.selection.modules
    if run.selection.kind == "every" or not modules:
        return list(run.counts)
    return [
        c
        for c in run.counts
        if any(
            m == mod or m.startswith(mod + ".")
            for f in c.files
            for m in [f.removesuffix(".py").replace("/", ".")]
            for mod in modules
        )
    ]


def _score_row(run: MutationRun, c: FileCounts, since: int) -> str:
    sample = run.selection.kind == "sample"
    cells = [
        c.label,
        run.when,
        f"{c.run:,}" + (f" of {c.frame:,}" if sample else ""),
        f"{c.killed:,}",
        f"{c.timeout:,}",
        f"{c.survived:,}",
        f"{c.no_tests + c.skipped + c.other:,}",
        f"**{_pct(c.detected, c.run)}**",
        _interval(c.detected, c.run, sample),
        _pct(c.detected + since, c.run),
    ]
    return "| " + " | ".join(cells) + " |"


def _scores(runs: Sequence[MutationRun]) -> list[str]:
    lines = [
        "## Scores",
        "",
        "Per package and run, newest run first; a run's section below has its files.",
        "",
        "| package | run | mutants run | killed | timed out | survived | no tests, skipped, "
        "other | score | 95 % interval | counting the killed since |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        for label in _labels(run):
            c = _sum(label, [x for x in _framed(run) if x.label == label])
            lines.append(_score_row(run, c, _killed_since(run, label)))
    return [*lines, ""]


def _selection(run: MutationRun) -> str:
    s = run.selection
    if s.kind == "every":
        return "every mutant of the scope"
    frame = sum(c.frame for c in _framed(run))
    within = f" of {', '.join(f'`{m}`' for m in s.modules)}" if s.modules else ""
    return (
        f"a uniform sample of {s.size:,} of the {frame:,} mutants{within}, drawn with "
        f"`random.Random({s.seed}).sample` from their sorted names"
    )


def _provenance(run: MutationRun) -> list[str]:
    lines = [
        f"- Command: `{run.command}`",
        f"- mutmut {run.mutmut}; measured {run.when} on commit "
        f"{f'`{run.commit}`' if run.commit else '(not recorded)'}"
        + (f"; {run.wall_s / 60:.0f} min" if run.wall_s is not None else ""),
        f"- Selection: {_selection(run)}.",
        f"- Mutated: {', '.join(f'`{f}`' for f in run.files)}.",
        f"- Tests ({len(run.tests)} files): {', '.join(f'`{t}`' for t in run.tests)}.",
    ]
    if run.settings:
        pairs = ", ".join(f"`{k}` = `{v}`" for k, v in sorted(run.settings.items()))
        lines.append(f"- Settings: {pairs}.")
    if run.recorded:
        lines.append(f"- Recorded: {run.recorded}")
    return [*lines, ""]


def _file_table(run: MutationRun) -> list[str]:
    lines = [
        "| files | mutants | run | killed | timed out | survived | no tests | skipped | other "
        "| not run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in run.counts:
        files = ", ".join(f"`{f}`" for f in c.files)
        nums = (c.frame, c.run, c.killed, c.timeout, c.survived, c.no_tests, c.skipped, c.other)
        lines.append(f"| {files} | " + " | ".join(f"{n:,}" for n in (*nums, c.not_checked)) + " |")
    return [*lines, ""]


def _name_order(name: str) -> tuple[str, int]:
    """A function's mutants in their numbers' order (9 before 10)."""
    head, _, number = name.rpartition("__mutmut_")
    return (head, int(number)) if number.isdigit() else (name, -1)


def _survivors(run: MutationRun) -> list[str]:
    if not run.survivors and not run.unnamed:
        return ["No survivor.", ""]
    lines = ["| survivor | verdict | reason |", "|---|---|---|"]
    for s in sorted(run.survivors, key=lambda s: _name_order(s.name)):
        lines.append(f"| `{s.name}` | {VERDICTS[s.verdict]} | {s.reason or '-'} |")
    for u in run.unnamed:
        lines.append(f"| {u.count} not named in the record | {VERDICTS[u.verdict]} | {u.reason} |")
    return [*lines, ""]


def _run_section(name: str, run: MutationRun) -> list[str]:
    lines = [f"### {run.title} ({run.when})", "", f"From `docs/mutation/{name}`.", ""]
    lines += _provenance(run)
    lines += _file_table(run)
    lines += [f"Survivors ({sum(c.survived for c in run.counts)}):", ""]
    lines += _survivors(run)
    if run.timeouts:
        names = ", ".join(f"`{t}`" for t in run.timeouts)
        lines += [f"Timed out ({len(run.timeouts)}, counted as detected): {names}.", ""]
    if run.note:
        lines += [run.note, ""]
    return lines


def render(docs: Sequence[tuple[str, MutationRun]]) -> str:
    """docs/MUTATION.md from the runs, newest first."""
    ordered = sorted(sorted(docs, key=lambda d: d[0]), key=lambda d: d[1].when, reverse=True)
    lines = [
        "# Mutation testing",
        "",
        f"<!-- Generated by `{COMMAND}` (`make mutation-report`) from the runs' JSON in "
        "docs/mutation/ and the survivors' reasons applied to it; do not edit. -->",
        "",
        "How well the tests catch a changed line of the block pool, the scheduler and "
        "migration: mutmut changes one thing at a time (an operator, a constant, a "
        "keyword) and runs the tests against each change. The figures below are read "
        "from mutmut's own results; every survivor is listed with what a person found it "
        "to be.",
        "",
        HOW,
        *_scores([r for _, r in ordered]),
        "## Runs",
        "",
    ]
    for name, run in ordered:
        lines += _run_section(name, run)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m refserve.conformance.mutation.report",
        description="Render docs/MUTATION.md from the mutation runs' JSON.",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("inputs", nargs="*", type=Path)
    args = p.parse_args(argv)
    try:
        target = check_output_file(args.out, "--out")
        docs = load(args.inputs)
        if not docs:
            raise InputFileError("no mutation run among the inputs")
    except (InputFileError, OutputPathError) as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(render(docs), encoding="utf-8")
    os.replace(tmp, target)  # never a half-written document
    print(f"report: wrote {args.out} from {len(docs)} run(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
