"""One mutation run as JSON (docs/mutation/*.json), and how it is read from mutmut.

mutmut 3 keeps its results beside the mutants it wrote: for every mutated source file
``mutants/<path>.meta``, a JSON object whose ``exit_code_by_key`` maps each mutant's name
(``refserve.core.scheduler.xǁSchedulerǁcommit__mutmut_3``) to the exit code of the tests
run against it (``None``: not run yet). :func:`read_mutants` reads those files for the
paths ``[tool.mutmut] only_mutate`` names, so the module names are never written here;
:func:`collect` turns them, for every mutant or for a drawn sample (:func:`draw`), into a
:class:`MutationRun`: the counts per file and every survivor, with the verdict and
one-line reason a person gave it in the reasons file (:func:`read_reasons`), which is
kept in docs/mutation/ so that a rerun finds the reasons again.

A run recorded before this format existed is the same record with ``recorded`` saying
where its figures were carried over from; where such a record kept only the sum over
several files, one :class:`FileCounts` holds those files together, and survivors it
never named are counted in :class:`UnnamedSurvivors`.
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from refserve.errors import InputFileError

FORMAT = "refserve-mutation"
VERSION = 1

# mutmut 3.8.1's statuses by exit code (mutmut/stats.py, status_by_exit_code); any other
# code is "suspicious" there. Copied, so that reading a run needs no mutmut installed.
STATUS_BY_EXIT_CODE: dict[int | None, str] = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    2: "check was interrupted by user",
    None: "not checked",
    33: "no tests",
    34: "skipped",
    35: "suspicious",
    36: "timeout",
    37: "caught by type check",
    -24: "timeout",
    24: "timeout",
    152: "timeout",
    255: "timeout",
    -11: "segfault",
    -9: "segfault",
}
# How a status is counted here: mutmut's own words, with the rare ones together.
BUCKET = {
    "killed": "killed",
    "timeout": "timeout",
    "survived": "survived",
    "no tests": "no_tests",
    "skipped": "skipped",
    "not checked": "not_checked",
}
COUNTS = ("killed", "timeout", "survived", "no_tests", "skipped", "other", "not_checked")

# A survivor's verdict after a person read it (``mutmut show NAME``).
VERDICTS = {
    "equivalent": "equivalent",
    "killed-since": "a test gap, killed since",
    "left": "not equivalent, left",
    "removed": "redundant code, removed",
    "untriaged": "not read yet",
}


def status_of(exit_code: int | None) -> str:
    """mutmut's status for an exit code (``"killed"``, ``"no tests"``, ...)."""
    return STATUS_BY_EXIT_CODE.get(exit_code, "suspicious")


def bucket_of(exit_code: int | None) -> str:
    """The column of :data:`COUNTS` that counts a mutant with this exit code."""
    return BUCKET.get(status_of(exit_code), "other")


def package_of(path: str) -> str:
    """``refserve/core/scheduler.py`` -> ``refserve.core``."""
    return path.rsplit("/", 1)[0].replace("/", ".") if "/" in path else path


def module_of(path: str) -> str:
    """``refserve/core/scheduler.py`` -> ``refserve.core.scheduler`` (mutmut's prefix)."""
    return path.removesuffix(".py").replace("/", ".")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``k`` of ``n`` (95 % by default), as fractions."""
    if n <= 0:
        raise ValueError("an interval needs at least one trial")
    p = k / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    den = 1 + z * z / n
    return max(0.0, (centre - spread) / den), min(1.0, (centre + spread) / den)


# --------------------------------------------------------------------- the records
@dataclass(frozen=True)
class FileCounts:
    """mutmut's verdicts over the mutants run in ``files`` (one file when measured
    here; several where a recorded run kept only their sum), and the frame: how many
    mutants mutmut generated in them, of which a sample ran a part."""

    files: tuple[str, ...]
    label: str
    frame: int
    killed: int = 0
    timeout: int = 0
    survived: int = 0
    no_tests: int = 0
    skipped: int = 0
    other: int = 0
    not_checked: int = 0

    @property
    def run(self) -> int:
        """Mutants with a verdict (every column but ``not_checked``)."""
        return sum(getattr(self, c) for c in COUNTS if c != "not_checked")

    @property
    def detected(self) -> int:
        """Killed or timed out: what mutmut's score counts as caught."""
        return self.killed + self.timeout

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"files": list(self.files), "label": self.label, "frame": self.frame}
        out.update({c: getattr(self, c) for c in COUNTS})
        return out


@dataclass(frozen=True)
class Verdict:
    """What a person found a surviving mutant to be, in one line; ``function_hash``, when
    given, is mutmut's hash of the mutated function's source when it was read."""

    verdict: str
    reason: str
    function_hash: str = ""


@dataclass(frozen=True)
class Survivor:
    """A surviving mutant; ``function_hash`` is mutmut's hash of the function's source
    in the run (empty where a recorded run did not keep it)."""

    name: str
    verdict: str = "untriaged"
    reason: str = ""
    function_hash: str = ""


@dataclass(frozen=True)
class UnnamedSurvivors:
    """Survivors a recorded run counted and explained but never named."""

    count: int
    verdict: str
    reason: str


@dataclass(frozen=True)
class Selection:
    """Which mutants ran: ``every`` one of the scope, or a uniform ``sample`` of
    ``size`` drawn with ``seed`` from the mutants of the modules ``modules`` names (a
    prefix each; none: every module of the scope)."""

    kind: str
    seed: int | None = None
    size: int | None = None
    modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class MutationRun:
    title: str
    when: str
    commit: str | None
    command: str
    mutmut: str
    files: tuple[str, ...]
    tests: tuple[str, ...]
    selection: Selection
    counts: tuple[FileCounts, ...]
    survivors: tuple[Survivor, ...] = ()
    unnamed: tuple[UnnamedSurvivors, ...] = ()
    timeouts: tuple[str, ...] = ()
    wall_s: float | None = None
    recorded: str = ""
    note: str = ""
    settings: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "title": self.title,
            "when": self.when,
            "commit": self.commit,
            "command": self.command,
            "mutmut": self.mutmut,
            "recorded": self.recorded,
            "scope": {"files": list(self.files), "tests": list(self.tests)},
            "settings": self.settings,
            "selection": {
                "kind": self.selection.kind,
                "seed": self.selection.seed,
                "size": self.selection.size,
                "modules": list(self.selection.modules),
            },
            "wall_s": self.wall_s,
            "counts": [c.to_json() for c in self.counts],
            "survivors": [vars(s) for s in self.survivors],
            "unnamed_survivors": [vars(u) for u in self.unnamed],
            "timeouts": list(self.timeouts),
            "note": self.note,
        }


# --------------------------------------------------------------------- reading JSON
def _need(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = doc.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise InputFileError(
            f"{where}: {key!r} is missing or not a {getattr(kind, '__name__', kind)}"
        )
    return value


def _counts_from(doc: Any, where: str) -> FileCounts:
    if not isinstance(doc, dict):
        raise InputFileError(f"{where}: a count is not an object")
    files = tuple(str(f) for f in _need(doc, "files", list, where))
    numbers = {c: _need(doc, c, int, where) for c in COUNTS}
    if any(v < 0 for v in numbers.values()):
        raise InputFileError(f"{where}: a negative count")
    counts = FileCounts(
        files, str(_need(doc, "label", str, where)), _need(doc, "frame", int, where), **numbers
    )
    if counts.run + counts.not_checked > counts.frame:
        raise InputFileError(f"{where}: {counts.label}: more mutants counted than generated")
    return counts


def _verdict_of(doc: Any, where: str) -> tuple[str, str]:
    if not isinstance(doc, dict):
        raise InputFileError(f"{where}: a survivor is not an object")
    verdict = str(_need(doc, "verdict", str, where))
    if verdict not in VERDICTS:
        raise InputFileError(f"{where}: unknown verdict {verdict!r} (one of {', '.join(VERDICTS)})")
    return verdict, str(_need(doc, "reason", str, where))


def run_from_json(doc: Any, where: str) -> MutationRun:
    """A run from its JSON; :class:`InputFileError` naming ``where`` when malformed."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise InputFileError(f"{where}: not a {FORMAT} version {VERSION} document")
    scope = _need(doc, "scope", dict, where)
    sel = _need(doc, "selection", dict, where)
    survivors = []
    for s in _need(doc, "survivors", list, where):
        verdict, reason = _verdict_of(s, where)
        name = str(_need(s, "name", str, where))
        survivors.append(Survivor(name, verdict, reason, str(s.get("function_hash") or "")))
    unnamed = []
    for u in _need(doc, "unnamed_survivors", list, where):
        verdict, reason = _verdict_of(u, where)
        unnamed.append(UnnamedSurvivors(_need(u, "count", int, where), verdict, reason))
    commit = doc.get("commit")
    wall = doc.get("wall_s")
    run = MutationRun(
        title=str(_need(doc, "title", str, where)),
        when=str(_need(doc, "when", str, where)),
        commit=str(commit) if commit is not None else None,
        command=str(_need(doc, "command", str, where)),
        mutmut=str(_need(doc, "mutmut", str, where)),
        files=tuple(str(f) for f in _need(scope, "files", list, where)),
        tests=tuple(str(t) for t in _need(scope, "tests", list, where)),
        selection=_selection_from(sel, where),
        counts=tuple(_counts_from(c, where) for c in _need(doc, "counts", list, where)),
        survivors=tuple(survivors),
        unnamed=tuple(unnamed),
        timeouts=tuple(str(t) for t in _need(doc, "timeouts", list, where)),
        wall_s=float(wall) if isinstance(wall, int | float) else None,
        recorded=str(doc.get("recorded", "")),
        note=str(doc.get("note", "")),
        settings=dict(doc.get("settings") or {}),
    )
    _check_survivors(run, where)
    return run


def _selection_from(sel: Mapping[str, Any], where: str) -> Selection:
    kind = str(_need(sel, "kind", str, where))
    if kind not in ("every", "sample"):
        raise InputFileError(f"{where}: the selection is 'every' or 'sample', not {kind!r}")
    seed, size = sel.get("seed"), sel.get("size")
    if kind == "sample" and not (isinstance(seed, int) and isinstance(size, int) and size > 0):
        raise InputFileError(f"{where}: a sample names its seed and its size")
    modules = tuple(str(m) for m in sel.get("modules") or ())
    return Selection(
        kind, seed if kind == "sample" else None, size if kind == "sample" else None, modules
    )


def _check_survivors(run: MutationRun, where: str) -> None:
    survived = sum(c.survived for c in run.counts)
    listed = len(run.survivors) + sum(u.count for u in run.unnamed)
    if listed != survived:
        raise InputFileError(
            f"{where}: {survived} mutants survived but {listed} survivors are listed"
        )
    names = [s.name for s in run.survivors]
    if len(set(names)) != len(names):
        raise InputFileError(f"{where}: a survivor is listed twice")


def load(paths: Sequence[Path]) -> list[tuple[str, MutationRun]]:
    """Every run in ``paths`` (docs/mutation/*.json), each with its file name."""
    out: list[tuple[str, MutationRun]] = []
    for p in paths:
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputFileError(f"{p}: cannot be read as JSON: {e}") from e
        out.append((p.name, run_from_json(doc, str(p))))
    return out


# --------------------------------------------------------------------- the reasons file
def read_reasons(path: Path) -> dict[str, Verdict]:
    """The reasons file: one survivor a line, ``NAME VERDICT REASON``; ``#`` starts a
    comment line. ``NAME@HASH`` ties the reason to the function's source as mutmut hashed
    it (:func:`with_reasons`). A name given twice, or an unknown verdict, is refused."""
    out: dict[str, Verdict] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split(None, 2)
        where = f"{path}:{number}"
        if len(parts) < 3:
            raise InputFileError(f"{where}: expected NAME VERDICT REASON")
        name, verdict, reason = parts
        name, _, function_hash = name.partition("@")
        if verdict not in VERDICTS or verdict == "untriaged":
            raise InputFileError(f"{where}: unknown verdict {verdict!r}")
        if name in out:
            raise InputFileError(f"{where}: {name} is given a reason twice")
        out[name] = Verdict(verdict, reason.strip(), function_hash)
    return out


def reason_for(survivor: Survivor, reasons: Mapping[str, Verdict]) -> Verdict:
    """The reasons file's verdict on ``survivor``, or ``untriaged``: when it names none,
    or when both sides carry mutmut's hash of the function and they differ (mutmut
    numbers a changed function's mutants anew, so the same name may be another change)."""
    given = reasons.get(survivor.name)
    if given is None:
        return Verdict("untriaged", "")
    stale = given.function_hash and survivor.function_hash
    if stale and given.function_hash != survivor.function_hash:
        return Verdict("untriaged", "")
    return given


def with_reasons(run: MutationRun, reasons: Mapping[str, Verdict]) -> MutationRun:
    """``run`` with each named survivor's verdict and reason as the reasons file says."""
    survivors = []
    for s in run.survivors:
        v = reason_for(s, reasons)
        survivors.append(replace(s, verdict=v.verdict, reason=v.reason))
    return replace(run, survivors=tuple(survivors))


# --------------------------------------------------------------------- mutmut's side
@dataclass(frozen=True)
class MutmutConfig:
    """What ``[tool.mutmut]`` in pyproject.toml says the scope is."""

    only_mutate: tuple[str, ...]
    tests: tuple[str, ...]
    settings: dict[str, Any]


def mutmut_config(pyproject: Path) -> MutmutConfig:
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    conf = data.get("tool", {}).get("mutmut")
    if not isinstance(conf, dict) or not conf.get("only_mutate"):
        raise InputFileError(f"{pyproject}: no [tool.mutmut] only_mutate")
    keys = ("timeout_multiplier", "timeout_constant", "process_isolation", "pytest_add_cli_args")
    return MutmutConfig(
        tuple(conf["only_mutate"]),
        tuple(conf.get("pytest_add_cli_args_test_selection", ())),
        {k: conf[k] for k in keys if k in conf},
    )


def read_mutants(root: Path, files: Sequence[str]) -> dict[str, dict[str, int | None]]:
    """Every mutant's exit code, per mutated file, from ``root`` (mutmut's ``mutants/``)."""
    out: dict[str, dict[str, int | None]] = {}
    for f in files:
        meta = root / (f + ".meta")
        if not meta.is_file():
            raise InputFileError(f"{meta}: no mutants of {f} (generate them first)")
        codes = json.loads(meta.read_text(encoding="utf-8")).get("exit_code_by_key")
        if not isinstance(codes, dict):
            raise InputFileError(f"{meta}: no exit_code_by_key")
        out[f] = dict(codes)
    return out


def read_function_hashes(root: Path, files: Sequence[str]) -> dict[str, str]:
    """mutmut's hash of each mutated function's source, by the function's full name
    (a mutant's name less ``__mutmut_N``)."""
    out: dict[str, str] = {}
    for f in files:
        meta = json.loads((root / (f + ".meta")).read_text(encoding="utf-8"))
        for fn, digest in (meta.get("hash_by_function_name") or {}).items():
            out[f"{module_of(f)}.{fn}"] = str(digest)
    return out


def function_of(mutant: str) -> str:
    """``refserve.kv.pool.xǁBlockPoolǁfree__mutmut_3`` -> ``refserve.kv.pool.xǁBlockPoolǁfree``."""
    return mutant.rsplit("__mutmut_", 1)[0]


def in_modules(name: str, modules: Sequence[str]) -> bool:
    """Whether mutant ``name`` lies in one of the module prefixes (none: every one)."""
    return not modules or any(name == m or name.startswith(m + ".") for m in modules)


def draw(
    by_file: Mapping[str, Mapping[str, int | None]],
    size: int,
    seed: int,
    modules: Sequence[str] = (),
) -> list[str]:
    """A uniform sample of ``size`` mutants without replacement, drawn with
    ``random.Random(seed)`` from the sorted names (of the modules given), in the draw's
    order: every prefix of it is itself a uniform sample, so a run cut short still is."""
    names = sorted(n for codes in by_file.values() for n in codes if in_modules(n, modules))
    if not 0 < size <= len(names):
        raise ValueError(f"a sample of {size} from {len(names)} mutants")
    return random.Random(seed).sample(names, size)


def collect(
    by_file: Mapping[str, Mapping[str, int | None]],
    chosen: Sequence[str] | None = None,
    hashes: Mapping[str, str] | None = None,
) -> tuple[tuple[FileCounts, ...], tuple[Survivor, ...], tuple[str, ...]]:
    """Counts per file, survivors (with their function's hash, from ``hashes``) and
    timeouts over ``chosen`` (None: every mutant)."""
    hashes = hashes or {}
    pick = None if chosen is None else set(chosen)
    counts, survivors, timeouts = [], [], []
    for f, codes in sorted(by_file.items()):
        column = dict.fromkeys(COUNTS, 0)
        for name, code in sorted(codes.items()):
            if pick is not None and name not in pick:
                continue
            b = bucket_of(code)
            column[b] += 1
            if b == "survived":
                survivors.append(Survivor(name, function_hash=hashes.get(function_of(name), "")))
            elif b == "timeout":
                timeouts.append(name)
        counts.append(FileCounts((f,), package_of(f), len(codes), **column))
    return tuple(counts), tuple(survivors), tuple(timeouts)
