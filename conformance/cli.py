"""``refserve conformance``: run the suite on an adapter and write the reports.

Usage::

    refserve conformance --adapter MODULE:FACTORY [--kv-adapter MODULE:FACTORY]
        [--scenarios NAME ...] [--examples N] [--call-timeout S] [--baseline REPORT.json]
        [--report report.json] [--markdown report.md] [--no-progress]
    refserve conformance --kv-adapter MODULE:FACTORY [...]      # the block manager alone
    refserve conformance --grouped-kv-adapter MODULE:FACTORY [...]   # one with layer groups
    refserve conformance --adapter MODULE:FACTORY --replay workload.json
    refserve conformance --adapter MODULE:FACTORY --exhaustive [--scope small]
        [--strategy replay|copy] [--counterexamples DIR] [--report explore.json]
    refserve conformance --adapter MODULE:FACTORY --self-check
    refserve conformance --corpus [--engine E] [--reproduction R]     # docs/CORPUS.md
        [--report corpus.json]
    refserve conformance --list

Exit status: 0 when nothing failed (``not_supported`` is not a failure), 1 when the
engine has findings, 2 on a usage error or a fault of the harness itself, 130 when
interrupted. An engine that hangs, raises or returns malformed records never takes the
run down: each is a finding (docs/CONFORMANCE.md). With ``--report`` the JSON report is
rewritten after every scenario (``"complete": false`` until the end), so a killed run
leaves a valid partial report. Every path is checked before the run starts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from refserve.conformance.guard import DEFAULT_CALL_TIMEOUT
from refserve.errors import OutputPathError
from refserve.files import check_output_file

if TYPE_CHECKING:
    from refserve.conformance.corpus.entry import Entry

T = TypeVar("T")
PROG = "refserve conformance"
MAX_EXAMPLES = 100_000
EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A bad option or input file: reported as one line, exit 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Check an engine's scheduler and KV manager against refserve's spec.",
        exit_on_error=False,
    )
    p.add_argument("--adapter", help="MODULE:FACTORY, e.g. refserve.conformance.adapters.ref:make")
    p.add_argument(
        "--kv-adapter",
        metavar="MODULE:FACTORY",
        help="also (or only) check a block manager alone through the KV adapter protocol",
    )
    p.add_argument(
        "--grouped-kv-adapter",
        metavar="MODULE:FACTORY",
        help="also (or only) check a block manager with layer groups (full attention, sliding "
        "windows) through the grouped KV protocol",
    )
    p.add_argument("--scenarios", nargs="+", metavar="NAME", help="run only these scenarios")
    p.add_argument("--report", type=Path, help="write the JSON report here (streamed)")
    p.add_argument("--markdown", type=Path, help="write the markdown report here")
    p.add_argument(
        "--examples", type=int, default=100, help="generated examples per search (default 100)"
    )
    p.add_argument(
        "--call-timeout",
        type=float,
        default=DEFAULT_CALL_TIMEOUT,
        metavar="SECONDS",
        help=f"limit of one adapter call; a call past it is a finding (default "
        f"{DEFAULT_CALL_TIMEOUT:g})",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        metavar="REPORT.json",
        help="suppress the findings of an earlier report, so the search goes past them",
    )
    p.add_argument("--replay", type=Path, help="run one workload JSON and print its trace")
    p.add_argument(
        "--exhaustive",
        action="store_true",
        help="explore every reachable state of a bounded scope instead of sampling "
        "(docs/CONFORMANCE.md, 'Exhaustive exploration')",
    )
    p.add_argument(
        "--scope",
        default="small",
        help="with --exhaustive: the named scope to exhaust (tiny, small, small-unchunked for an "
        "engine without chunked prefill, small-spec, medium; default small), or a JSON file "
        "holding a scope of your own",
    )
    p.add_argument(
        "--scope-set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="with --exhaustive: change one field of the scope (block_size, num_blocks or "
        "blocks, budget, max_seqs, max_requests, catalogue as '2,3,4:3 7,8:1', ...); "
        "repeatable",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="with --exhaustive: explore the scope at every budget and pool size one below, "
        "at and one above what one of its requests needs",
    )
    p.add_argument(
        "--strategy",
        default="replay",
        choices=("replay", "copy"),
        help="with --exhaustive: reach each state by replaying its path on a fresh adapter "
        "(any adapter; the default) or by deep-copying the parent's (adapters that copy)",
    )
    p.add_argument(
        "--counterexamples",
        type=Path,
        metavar="DIR",
        help="with --exhaustive: write each counterexample's workload here, for --replay",
    )
    p.add_argument(
        "--self-check",
        action="store_true",
        help="run one trivial workload and explain what in the adapter's records is off",
    )
    p.add_argument(
        "--corpus",
        action="store_true",
        help="run every entry of the corpus of real bugs that this environment reaches "
        "(docs/CORPUS.md): the buggy code must be caught and the clean code must pass",
    )
    p.add_argument(
        "--engine",
        metavar="E",
        help="with --corpus: only this engine's entries (vllm, nano-vllm, sglang, lmdeploy; "
        "modelled: tensorrt-llm, lmcache)",
    )
    p.add_argument(
        "--reproduction",
        metavar="R",
        help="with --corpus: only the entries reproduced this way (released, reapplied, "
        "model; models need no third-party engine)",
    )
    p.add_argument("--list", action="store_true", help="list the scenario names and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks of harness errors")
    return p


def conformance_main(argv: list[str]) -> int:
    debug = "--debug" in argv
    try:
        return _main(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # a fault of the harness itself, never of the engine under test
        if debug:
            traceback.print_exc()
        print(
            f"{PROG}: error: internal error: {type(e).__name__}: {e} (--debug shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_USAGE


def _parse(argv: list[str]) -> argparse.Namespace:
    try:
        args = _parser().parse_args(argv)
    except argparse.ArgumentError as e:
        raise UsageError(str(e)) from None
    except SystemExit as e:  # --help, or an error argparse reports itself
        code = e.code if isinstance(e.code, int) else EXIT_USAGE
        raise _Exit(code) from None
    if not 1 <= args.examples <= MAX_EXAMPLES:
        raise UsageError(f"--examples must be between 1 and {MAX_EXAMPLES}, got {args.examples}")
    t = args.call_timeout
    if not math.isfinite(t) or not 0 < t <= 3600:
        raise UsageError(f"--call-timeout must be a number of seconds in (0, 3600], got {t}")
    return args


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _main(argv: list[str]) -> int:
    try:
        args = _parse(argv)
    except _Exit as e:
        return e.code
    from refserve.conformance.suite import scenario_names

    if args.list:
        print("\n".join(scenario_names()))
        return EXIT_OK
    if args.corpus:
        return _corpus(args, argv)
    _check_suite_options(args)
    if args.self_check:
        return _self_check(args)
    if args.replay is not None:
        return _replay(args)
    if args.exhaustive:
        return _exhaustive(args)
    if args.sweep or args.scope_set:
        raise UsageError("--sweep and --scope-set shape an exploration: add --exhaustive")
    return _suite(args)


def _check_suite_options(args: argparse.Namespace) -> None:
    """Usage errors of a run that is not ``--corpus``."""
    if args.engine:
        raise UsageError("--engine picks corpus entries: add --corpus")
    if args.reproduction:
        raise UsageError("--reproduction picks corpus entries: add --corpus")
    if not (args.adapter or args.kv_adapter or args.grouped_kv_adapter):
        raise UsageError(
            "--adapter MODULE:FACTORY (or --kv-adapter, --grouped-kv-adapter) is required"
        )
    if args.grouped_kv_adapter and (args.self_check or args.exhaustive):
        raise UsageError("--grouped-kv-adapter runs the grouped suite or --replay only")


def _corpus(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the reachable corpus entries; exit 1 when one is not caught or its clean
    side is not clean, 0 otherwise (entries this environment cannot reach are listed)."""
    if args.adapter or args.kv_adapter or args.grouped_kv_adapter:
        raise UsageError("--corpus runs the corpus's own adapters: drop --adapter/--kv-adapter")
    from refserve.conformance.corpus.report import document, table
    from refserve.conformance.corpus.run import run_entries

    chosen = _corpus_entries(args.engine, args.reproduction)
    if args.report is not None:
        _check_writable(args.report)
    results = run_entries(chosen, call_timeout=args.call_timeout)
    print(table(results))
    if args.report is not None:
        doc = document(results, "refserve conformance " + " ".join(argv), _engine_versions())
        _write_atomic(args.report, json.dumps(doc, indent=2) + "\n")
    ran = [r for r in results if not r.skipped]
    bad = [r for r in ran if not r.ok]
    print(
        f"{len(ran)} of {len(results)} entries ran here: {len(ran) - len(bad)} caught with a "
        f"clean fixed side, {len(bad)} not"
    )
    return EXIT_FINDINGS if bad else EXIT_OK


def _corpus_entries(engine: str | None, reproduction: str | None) -> list[Entry]:
    """The catalogue's entries of ``engine`` reproduced as ``reproduction`` (``None``:
    any); a name the catalogue does not have is a usage error."""
    from refserve.conformance.corpus.catalogue import ENTRIES
    from refserve.conformance.corpus.entry import Reproduction

    engines = sorted({e.engine for e in ENTRIES})
    if engine is not None and engine not in engines:
        raise UsageError(f"--engine must be one of {', '.join(engines)}, got {engine!r}")
    kinds = [str(r) for r in Reproduction]
    if reproduction is not None and reproduction not in kinds:
        raise UsageError(f"--reproduction must be one of {', '.join(kinds)}, got {reproduction!r}")
    return [
        e
        for e in ENTRIES
        if engine in (None, e.engine) and reproduction in (None, str(e.reproduction))
    ]


def _engine_versions() -> dict[str, str]:
    """The installed versions of the engines the corpus drives (absent ones left out)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {}
    for dist in ("vllm", "nano-vllm-fork", "sglang", "lmdeploy"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out


def _self_check(args: argparse.Namespace) -> int:
    if not args.adapter:
        raise UsageError("--self-check needs --adapter MODULE:FACTORY")
    from refserve.conformance.selfcheck import self_check_main

    return self_check_main(args.adapter, args.call_timeout)


def _suite(args: argparse.Namespace) -> int:
    """The suite itself (engine and/or KV level), once the outputs, the baseline and the
    adapters are known to be usable."""
    for out in (args.report, args.markdown):
        if out is not None:
            _check_writable(out)
    baseline = _load_baseline(args.baseline) if args.baseline is not None else frozenset()
    factory = _load(args.adapter) if args.adapter else None
    kv_factory = _load_kv(args.kv_adapter) if args.kv_adapter else None
    grouped = _load_grouped(args.grouped_kv_adapter) if args.grouped_kv_adapter else None
    if args.scenarios and factory is None:
        raise UsageError("--scenarios selects engine scenarios: it needs --adapter")
    return _run(args, factory, kv_factory, baseline, grouped)


def _run(
    args: argparse.Namespace,
    factory: Any,
    kv_factory: Any,
    baseline: frozenset[str],
    grouped: Any = None,
) -> int:
    from refserve.conformance.report import Report, Result, ScenarioInfo, to_markdown
    from refserve.conformance.suite import run_suite, scenario_names

    names = args.scenarios
    if names:
        unknown = set(names) - set(scenario_names())
        if unknown:
            raise UsageError(f"unknown scenarios: {', '.join(sorted(unknown))}")
    total = (len(names) if names else len(scenario_names())) if factory is not None else 0
    if kv_factory is not None:
        from refserve.conformance.kv.machine import kv_scenario_names

        total += len(kv_scenario_names())
    if grouped is not None:
        from refserve.conformance.kv.grouped_suite import grouped_scenario_names

        total += len(grouped_scenario_names())
    state: dict[str, Any] = {"results": [], "infos": [], "current": "setup"}
    header: dict[str, Any] = {"engine": "unknown", "features": (), "properties": {}}

    def partial(complete: bool = False, extra: tuple[Any, ...] = ()) -> Report:
        return Report(
            args.adapter or "",
            header["engine"],
            tuple(header["features"]),
            tuple(state["results"]) + tuple(extra),
            tuple(state["infos"]),
            header.get("policy", {}),
            tuple(header.get("notes", ())),
            properties=dict(header["properties"]),
            complete=complete,
            kv_adapter=args.kv_adapter or "",
            grouped_kv_adapter=args.grouped_kv_adapter or "",
        )

    def on_start(name: str) -> None:
        state["current"] = name
        bar.set_description(name)

    def on_result(rs: list[Result], info: ScenarioInfo) -> None:
        state["results"].extend(rs)
        state["infos"].append(info)
        bar.update(1)
        if args.report is not None:
            partial().dump(args.report)

    def on_stuck(what: str) -> int:
        from refserve.conformance.report import Failure, signature_of

        msg = (
            f"{what} did not return within {args.call_timeout:g} s and could not be "
            "interrupted (blocked in native code); the run was stopped"
        )
        f = Failure(
            -1, "step", "engine", msg, "", "", {}, [], signature_of("PROGRESS", "engine", msg)
        )
        stuck = Result(state["current"], "PROGRESS", "fail", "", f)
        if args.report is not None:
            partial(extra=(stuck,)).dump(args.report)
        print(f"\n{PROG}: FAIL {state['current']} PROGRESS: {msg}", file=sys.stderr)
        return EXIT_FINDINGS

    from refserve.conformance.guard import Watchdog

    with Watchdog(grace=max(5.0, args.call_timeout), on_stuck=on_stuck):
        _check_adapters(args, factory, kv_factory, grouped)
        bar = _progress(total, disabled=args.no_progress)  # after the check: one error line
        if factory is not None:
            report = run_suite(
                factory,
                args.adapter,
                names,
                max_examples=args.examples,
                call_timeout=args.call_timeout,
                baseline=baseline,
                on_result=on_result,
                on_start=on_start,
            )
            header.update(
                engine=report.engine,
                features=report.features,
                properties=report.properties,
                policy=report.policy,
                notes=report.notes,
            )
        if kv_factory is not None:
            from refserve.conformance.kv.machine import run_kv_suite

            on_start("kv-*")
            for rs, info in run_kv_suite(
                kv_factory,
                args.kv_adapter,
                max_examples=args.examples,
                call_timeout=args.call_timeout,
                known=baseline,
            ):
                on_result(rs, info)
        if grouped is not None:
            from refserve.conformance.kv.grouped_suite import run_grouped_kv_suite

            on_start("kv-groups-*")
            for rs, info in run_grouped_kv_suite(
                grouped,
                args.grouped_kv_adapter,
                max_examples=args.examples,
                call_timeout=args.call_timeout,
                known=baseline,
            ):
                on_result(rs, info)
    bar.close()
    final = partial(complete=True)
    if args.report is not None:
        final.dump(args.report)
    if args.markdown is not None:
        _write_atomic(args.markdown, to_markdown(final))
    _print_summary(final)
    return EXIT_FINDINGS if final.failed else EXIT_OK


def _print_summary(report: Any) -> None:
    if report.adapter:
        who = report.engine
    elif report.kv_adapter:
        who = f"KV adapter {report.kv_adapter}"
    else:
        who = f"grouped KV adapter {report.grouped_kv_adapter}"
    print(f"{who}: {report.headline()}")
    for r in report.results:
        for f in r.failures:
            print(f"  FAIL {r.scenario} {r.invariant}: step {f.step}: {f.subject}: {f.message}")
    for n in report.notes:
        print(f"  note: {n}")


class _NoBar:
    def set_description(self, desc: str) -> None: ...

    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def _progress(total: int, *, disabled: bool) -> Any:
    """A tqdm bar on stderr naming the scenario; off when stderr is not a terminal."""
    if disabled or total == 0 or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="scenario", file=sys.stderr, leave=False)


def _check_writable(path: Path) -> None:
    """Refuse an output path before the run, not after it (parents are created): the
    checks every refserve command makes, so a report never replaces a directory or a
    device such as /dev/null by its atomic rename."""
    try:
        check_output_file(path, "report")
    except OutputPathError as e:
        raise UsageError(str(e)) from None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise UsageError(f"{what} {path}: is a directory") from None
    except OSError as e:
        raise UsageError(f"{what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {path}: not UTF-8 text ({e.reason})") from None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise UsageError(f"{what} {path}: not valid JSON ({e})") from None


def _load_baseline(path: Path) -> frozenset[str]:
    from refserve.conformance.report import Report

    data = _read_json(path, "--baseline")
    try:
        return Report.from_json(data).signatures()
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"--baseline {path}: not a conformance report ({e})") from None


def _load_with(loader: Callable[[str], Any], spec: str, flag: str) -> Any:
    try:
        return loader(spec)
    except Exception as e:  # importing someone else's module can raise anything
        raise UsageError(f"{flag} {spec}: {type(e).__name__}: {e}") from None


def _load(spec: str) -> Any:
    from refserve.conformance.adapter import load_factory

    return _load_with(load_factory, spec, "--adapter")


def _load_kv(spec: str) -> Any:
    from refserve.conformance.kv.machine import load_kv_factory

    return _load_with(load_kv_factory, spec, "--kv-adapter")


def _load_grouped(spec: str) -> Any:
    from refserve.conformance.kv.grouped_suite import load_grouped_kv_factory

    return _load_with(load_grouped_kv_factory, spec, "--grouped-kv-adapter")


def _check_exploration(args: argparse.Namespace) -> None:
    if bool(args.adapter) == bool(args.kv_adapter):
        raise UsageError(
            "--exhaustive explores one adapter: give --adapter MODULE:FACTORY or --kv-adapter"
        )
    if args.kv_adapter and (args.sweep or args.scope_set):
        raise UsageError("--sweep and --scope-set explore an engine: use them with --adapter")


def _exhaustive(args: argparse.Namespace) -> int:
    """``--exhaustive``: explore every state of a scope (docs/CONFORMANCE.md,
    "Exhaustive exploration"), the engine with ``--adapter`` or the block manager alone
    with ``--kv-adapter``."""
    _check_exploration(args)
    for out in (args.report, args.markdown):
        if out is not None:
            _check_writable(out)
    if args.counterexamples is not None:
        try:
            args.counterexamples.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--counterexamples {args.counterexamples}: {e.strerror}") from None
    res, failures = _explore_kv(args) if args.kv_adapter else _explore_engine(args)
    if res.not_supported:
        print(res.summary())
        return EXIT_OK
    flag, spec = (
        ("--kv-adapter", args.kv_adapter) if args.kv_adapter else ("--adapter", args.adapter)
    )
    md = [f"# Exhaustive exploration: {res.engine}", "", res.summary(), ""]
    for i, (text, workload) in enumerate(failures, 1):
        print(text)
        md.append(f"## Counterexample {i}\n\n```\n{text}\n```\n")
        if args.counterexamples is not None:
            path = args.counterexamples / f"counterexample-{i}.json"
            _write_atomic(path, json.dumps(workload, indent=1) + "\n")
            print(f"  replay: refserve conformance {flag} {spec} --replay {path}")
    if args.report is not None:
        _write_atomic(args.report, json.dumps(res.to_json(), indent=1) + "\n")
    if args.markdown is not None:
        _write_atomic(args.markdown, "\n".join(md))
    print(res.summary())
    return EXIT_FINDINGS if failures else EXIT_OK


def _watched(args: argparse.Namespace, fn: Callable[[], T]) -> T:
    """``fn`` under the watchdog: an adapter call stuck in native code ends the process
    with a FAIL line instead of hanging it."""
    from refserve.conformance.guard import Watchdog

    def on_stuck(what: str) -> int:
        print(
            f"{PROG}: FAIL PROGRESS: {what} did not return within {args.call_timeout:g} s "
            "and could not be interrupted (blocked in native code); the exploration was "
            "stopped",
            file=sys.stderr,
        )
        return EXIT_FINDINGS

    with Watchdog(grace=max(5.0, args.call_timeout), on_stuck=on_stuck):
        return fn()


def _engine_scope(args: argparse.Namespace) -> Any:
    """The scope ``--scope`` names or holds (a JSON file), changed by ``--scope-set``."""
    from refserve.conformance.explore import SCOPES, ScopeError, user_scope
    from refserve.conformance.explore.scope import sweep

    try:
        if args.scope in SCOPES:
            base = SCOPES[args.scope]
        elif args.scope.endswith(".json") or Path(args.scope).is_file():
            fields = _read_json(Path(args.scope), "--scope")
            if not isinstance(fields, dict):
                raise UsageError(f"--scope {args.scope}: a scope is a JSON object")
            base = user_scope(fields)
        else:
            raise UsageError(
                f"--scope must be one of {', '.join(SCOPES)} or a JSON file, got {args.scope!r}"
            )
        pairs = {}
        for item in args.scope_set:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise UsageError(f"--scope-set wants FIELD=VALUE, got {item!r}")
            pairs[key.strip()] = value.strip()
        scope = user_scope(pairs, base) if pairs else base
        if args.sweep:
            sweep(scope)  # refuses, naming the count, a sweep too large to finish
        return scope
    except ScopeError as e:
        raise UsageError(f"--scope: {e}") from None


def _explore_engine(args: argparse.Namespace) -> tuple[Any, list[tuple[str, Any]]]:
    from refserve.conformance.explore import explore, explore_sweep

    scope = _engine_scope(args)
    factory = _load(args.adapter)

    def run() -> Any:
        _check_adapters(args, factory, None)
        if args.sweep:
            return explore_sweep(
                factory, scope, strategy=args.strategy, call_timeout=args.call_timeout
            )
        return explore(factory, scope, strategy=args.strategy, call_timeout=args.call_timeout)

    res = _watched(args, run)
    if args.sweep:
        print("\n".join(res.lines()))
    points = res.points if args.sweep else [res]
    failures = []
    for point in points:
        for c in point.counterexamples:
            lines = [f"FAIL {c.kind}: {c.finding}"]
            if args.sweep:
                lines.append(f"  at {point.scope.describe()} ({point.scope.name})")
            lines.append(f"  shortest path ({len(c.path)} events): {', '.join(map(str, c.path))}")
            if c.cycle:
                lines.append(f"  then forever: {', '.join(map(str, c.cycle))}")
            lines.append(c.table)
            failures.append(("\n".join(lines), c.workload.to_json()))
    return res, failures


def _explore_kv(args: argparse.Namespace) -> tuple[Any, list[tuple[str, Any]]]:
    from refserve.conformance.explore import KV_SCOPES, explore_kv

    scope = KV_SCOPES.get(args.scope)
    if scope is None:
        raise UsageError(
            f"--scope with --kv-adapter must be one of {', '.join(KV_SCOPES)}, got {args.scope!r}"
        )
    factory = _load_kv(args.kv_adapter)

    def run() -> Any:
        _check_adapters(args, None, factory)
        return explore_kv(factory, scope, strategy=args.strategy, call_timeout=args.call_timeout)

    res = _watched(args, run)
    failures = [
        (f"FAIL {c.finding}\n  shortest path: {len(c.workload.ops)} ops", c.workload.to_json())
        for c in res.counterexamples
    ]
    return res, failures


def _check_adapters(
    args: argparse.Namespace, factory: Any, kv_factory: Any, grouped: Any = None
) -> None:
    """Refuse, before any scenario runs, a factory whose product is not an adapter at
    all (a usage error: the wrong MODULE:FACTORY). Without this the first attribute the
    suite reads is reported as a finding of an engine that was never there."""
    from refserve.conformance.adapter import ENGINE_ADAPTER_ATTRIBUTES, ENGINE_ADAPTER_METHODS
    from refserve.conformance.kv.protocol import KV_ADAPTER_ATTRIBUTES, KV_ADAPTER_METHODS

    t = args.call_timeout
    if factory is not None:
        engine = (ENGINE_ADAPTER_ATTRIBUTES, ENGINE_ADAPTER_METHODS)
        _check_members(factory, args.adapter, "--adapter", "an engine adapter", engine, t)
    if kv_factory is not None:
        kv = (KV_ADAPTER_ATTRIBUTES, KV_ADAPTER_METHODS)
        _check_members(kv_factory, args.kv_adapter, "--kv-adapter", "a KV adapter", kv, t)
    if grouped is not None:
        from refserve.conformance.kv.grouped_suite import GROUPED_ADAPTER_MEMBERS

        spec, what = args.grouped_kv_adapter, "a grouped KV adapter"
        _check_members(grouped, spec, "--grouped-kv-adapter", what, GROUPED_ADAPTER_MEMBERS, t)


def _check_members(
    factory: Callable[[], object],
    spec: str,
    flag: str,
    what: str,
    members: tuple[tuple[str, ...], tuple[str, ...]],
    timeout: float,
) -> None:
    """UsageError naming what the factory's product lacks of the protocol (``members``:
    attributes, methods). A factory that raises or hangs is left to the run, which
    reports it as a finding: that is the engine's fault (a missing extension, say), not
    a wrong name."""
    from refserve.conformance.adapter import missing_members
    from refserve.conformance.guard import AdapterCallError, call

    try:
        missing = call(
            "the adapter factory",
            lambda: missing_members(factory(), *members),
            timeout,
        )
    except AdapterCallError:
        return
    if missing:
        raise UsageError(
            f"{flag} {spec} does not return {what}: missing {', '.join(missing)} (docs/ADAPTERS.md)"
        )


def _replay(args: argparse.Namespace) -> int:
    from refserve.conformance.runner import run_fresh
    from refserve.conformance.workload import Workload

    data = _read_json(args.replay, "--replay")
    if isinstance(data, dict) and "workload" in data and "config" not in data:
        data = data["workload"]  # a report's failure object
    if isinstance(data, dict) and "ops" in data:
        grouped = "grouped_kv_config" in data
        return _replay_grouped(args, data) if grouped else _replay_kv(args, data)
    if not args.adapter:
        raise UsageError("--replay of an engine workload needs --adapter")
    try:
        workload = Workload.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UsageError(
            f"--replay {args.replay}: not a workload ({type(e).__name__}: {e})"
        ) from None
    factory = _load(args.adapter)
    _check_adapters(args, factory, None)
    result = run_fresh(factory, workload, call_timeout=args.call_timeout)
    print(json.dumps({"trace": result.trace}, indent=1))
    if result.not_supported:
        print(f"not supported: {result.not_supported}")
        return EXIT_OK
    for f in result.findings:
        print(f"FAIL {f}")
    return EXIT_FINDINGS if result.findings else EXIT_OK


def _replay_kv(args: argparse.Namespace, data: dict[str, Any]) -> int:
    if not args.kv_adapter:
        raise UsageError("--replay of a KV workload (with 'ops') needs --kv-adapter")
    from refserve.conformance.kv.machine import replay_kv

    kv_factory = _load_kv(args.kv_adapter)
    _check_adapters(args, None, kv_factory)
    kv_findings = replay_kv(kv_factory, data)
    for kf in kv_findings:
        print(f"FAIL {kf}")
    return EXIT_FINDINGS if kv_findings else EXIT_OK


def _replay_grouped(args: argparse.Namespace, data: dict[str, Any]) -> int:
    if not args.grouped_kv_adapter:
        raise UsageError("--replay of a grouped KV workload needs --grouped-kv-adapter")
    from refserve.conformance.adapter import NotSupported
    from refserve.conformance.kv.grouped_run import replay_grouped

    grouped = _load_grouped(args.grouped_kv_adapter)
    _check_adapters(args, None, None, grouped)
    try:
        findings = replay_grouped(grouped, data, call_timeout=args.call_timeout)
    except ValueError as e:
        raise UsageError(f"--replay {args.replay}: not a grouped workload ({e})") from None
    except NotSupported as e:
        print(f"not supported: {e}")
        return EXIT_OK
    for f in findings:
        print(f"FAIL {f}")
    return EXIT_FINDINGS if findings else EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(conformance_main(sys.argv[1:]))
