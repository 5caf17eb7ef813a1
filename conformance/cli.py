"""``refserve conformance``: run the suite on an adapter and write the reports.

Usage::

    refserve conformance --adapter MODULE:FACTORY [--scenarios NAME ...]
        [--report report.json] [--markdown report.md] [--examples N]
    refserve conformance --adapter MODULE:FACTORY --replay workload.json
    refserve conformance --list

Exit status: 0 when nothing failed (``not_supported`` is not a failure), 1 when any
(scenario, invariant) failed, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="refserve conformance",
        description="Check an engine's scheduler and KV manager against refserve's spec.",
    )
    p.add_argument("--adapter", help="MODULE:FACTORY, e.g. conformance.adapters.ref:make")
    p.add_argument("--scenarios", nargs="+", metavar="NAME", help="run only these scenarios")
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument("--markdown", type=Path, help="write the markdown report here")
    p.add_argument(
        "--examples", type=int, default=100, help="Hypothesis examples per generated scenario"
    )
    p.add_argument("--replay", type=Path, help="run one workload JSON and print its trace")
    p.add_argument("--list", action="store_true", help="list the scenario names and exit")
    return p


def conformance_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from conformance.suite import scenario_names

    if args.list:
        print("\n".join(scenario_names()))
        return 0
    if not args.adapter:
        print("refserve conformance: error: --adapter MODULE:FACTORY is required", file=sys.stderr)
        return 2
    from conformance.adapter import load_factory

    try:
        factory = load_factory(args.adapter)
    except (ImportError, ValueError) as e:
        print(f"refserve conformance: error: {e}", file=sys.stderr)
        return 2
    if args.replay is not None:
        return _replay(factory, args.replay)
    from conformance.report import to_markdown
    from conformance.suite import run_suite

    try:
        report = run_suite(factory, args.adapter, args.scenarios, max_examples=args.examples)
    except ValueError as e:
        print(f"refserve conformance: error: {e}", file=sys.stderr)
        return 2
    if args.report is not None:
        report.dump(args.report)
    if args.markdown is not None:
        args.markdown.write_text(to_markdown(report))
    s = report.summary()
    print(
        f"{report.engine}: {s['fail']} failed, {s['pass']} passed, "
        f"{s['not_supported']} not supported"
    )
    for r in report.results:
        if r.failure is not None:
            f = r.failure
            print(f"  FAIL {r.scenario} {r.invariant}: step {f.step}: {f.subject}: {f.message}")
    return 1 if report.failed else 0


def _replay(factory: object, path: Path) -> int:
    from conformance.adapter import AdapterFactory
    from conformance.runner import run_workload
    from conformance.workload import Workload

    assert callable(factory)
    fac: AdapterFactory = factory
    data = json.loads(path.read_text())
    if "workload" in data and "config" not in data:
        data = data["workload"]  # a report's failure object
    result = run_workload(fac(), Workload.from_json(data))
    print(json.dumps({"trace": result.trace}, indent=1))
    if result.not_supported:
        print(f"not supported: {result.not_supported}")
        return 0
    for f in result.findings:
        print(f"FAIL {f}")
    return 1 if result.findings else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(conformance_main(sys.argv[1:]))
