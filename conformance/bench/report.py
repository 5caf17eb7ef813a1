"""docs/BENCHMARKS.md from the benchmarks' own JSON (``make bench``, ``make bench-peers``).

Run::

    python -m refserve.conformance.bench.report --out docs/BENCHMARKS.md docs/bench/*.json

Every input is one benchmark's JSON as its writer left it: the step bench and the
side-by-side run (``refserve.conformance.bench.peers``, ``out/bench-step.json`` and
``out/bench-peers.json``), the heap per request (``refserve.conformance.bench.memory``,
``out/bench-memory.json``), pytest-benchmark's ``--benchmark-json`` (``make bench``,
``out/bench-pytest.json``) and the soak's (``make soak``, ``out/soak.json``). Each
becomes a section with its tables, the command that produced it and the machine it ran
on (recorded in the JSON when it was measured: :mod:`refserve.conformance.bench.machine`),
and a ratio wherever the run measured a baseline.

Figures are never typed by hand: the Makefile copies fresh JSON into ``docs/bench/``
and reruns this, and ``tests/repo/test_benchmarks_doc.py`` requires the committed
docs/BENCHMARKS.md to equal what the committed JSON renders. A file that is not one of
these formats is skipped with one line on stderr (so ``out/*.json``, which also holds
conformance reports, works); no renderable input at all is an error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refserve.conformance.bench import ab, memory, migration, simfit
from refserve.conformance.bench.machine import machine_line
from refserve.conformance.bench.render import render_pool, render_steps
from refserve.conformance.bench.results import Run
from refserve.conformance.bench.soak import FORMAT as SOAK_FORMAT
from refserve.errors import OutputPathError
from refserve.files import check_output_file
from refserve.kernels.bench import FORMAT as GPU_FORMAT

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Kind:
    """One kind of benchmark JSON: its section's title, the command that regenerates it,
    and its renderer (body lines under the section's heading)."""

    key: str
    title: str
    make: str
    render: Callable[[dict[str, Any]], list[str]]
    intro: str = ""
    """What the section compares, in words (fixed text: never a figure)."""


def kind_of(doc: object) -> str | None:
    """Which benchmark wrote ``doc`` (a key of :data:`KINDS`), or None."""
    if not isinstance(doc, dict):
        return None
    fmt = doc.get("format")
    if fmt == "refserve-bench-peers":
        # The step bench is the same driver with refserve alone (bulk path and the
        # reference loop): its ratios are refserve against itself, not against peers.
        engines = set(dict(doc.get("engines") or {}))
        return "step" if engines <= {"ref", "ref-loop"} else "peers"
    by_format = {
        memory.FORMAT: "memory",
        ab.FORMAT: "ab",
        GPU_FORMAT: "gpu",
        simfit.FORMAT: "simfit",
        SOAK_FORMAT: "soak",
    }
    if fmt in by_format:
        return by_format[str(fmt)]
    if isinstance(doc.get("benchmarks"), list) and isinstance(doc.get("machine_info"), dict):
        # The migration bench is a pytest-benchmark run of its own (its own JSON, its
        # own table): every benchmark in it carries the format in its extra_info.
        infos = [b.get("extra_info") or {} for b in doc["benchmarks"]]
        if infos and all(i.get("format") == migration.FORMAT for i in infos):
            return "migration"
        return "pytest"
    return None


# --------------------------------------------------------------------- the sections
def _provenance(command: str, when: str, machine: dict[str, Any], extra: str = "") -> list[str]:
    lines = [f"Command: `{command}`" + (f", run {when}" if when else "") + "."]
    lines.append((machine_line(machine) + "." if machine else "Machine: not recorded.") + extra)
    return [" ".join(lines), ""]


def _peers_body(doc: dict[str, Any]) -> list[str]:
    run = Run.from_json(doc)
    load_after = " / ".join(f"{x:.2f}" for x in run.load_after)
    pin = (
        f" Every worker pinned to CPU {run.pinned_cpu} (`--cpu`)."
        if run.pinned_cpu is not None
        else " Workers not pinned (`--no-pin`): the OS placed them."
    )
    extra = (f" Load average {load_after} at the end." if load_after else "") + pin
    lines = _provenance(run.command, run.started, run.machine, extra)
    if "steps" in run.parts:
        lines += render_steps(run, level=3)
    if "pool" in run.parts:
        lines += render_pool(run, level=3)
    return lines


def _memory_body(doc: dict[str, Any]) -> list[str]:
    w = doc.get("workload", {})
    lo, hi = w.get("prompt_tokens", ["?", "?"])
    load_after = " / ".join(f"{x:.2f}" for x in doc.get("load_after", []))
    extra = f" Load average {load_after} at the end." if load_after else ""
    return [
        *_provenance(
            str(doc.get("command", "")), str(doc.get("when", "")), doc.get("machine", {}), extra
        ),
        "tracemalloc on the bulk decode path, prefix caching "
        f"{'on' if w.get('prefix_caching') else 'off'}, block {w.get('block_size', '?')}, "
        f"prompts of {lo}-{hi} tokens, {w.get('blocks_per_request', '?')} blocks of pool per "
        "request: the heap held while N requests decode, and the peak one full step "
        "(schedule + build_inputs + commit) allocates above what it started with, both per "
        "running request.",
        "",
        *memory.table(memory.figures_of(doc)),
        "",
    ]


def _simfit_body(doc: dict[str, Any]) -> list[str]:
    load_after = " / ".join(f"{x:.2f}" for x in doc.get("load_after", []))
    extra = f" Load average {load_after} at the end." if load_after else ""
    return [
        *_provenance(
            str(doc.get("command", "")), str(doc.get("when", "")), doc.get("machine", {}), extra
        ),
        *simfit.table(doc),
    ]


def _ab_body(doc: dict[str, Any]) -> list[str]:
    figures = [ab.Figure(f["name"], tuple(f["base_s"]), tuple(f["new_s"])) for f in doc["figures"]]
    return [ab.to_markdown(figures, doc), ""]


def _seconds(x: float) -> str:
    """A duration with the unit that keeps three significant digits readable."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x / 1e-9:.3g} ns"


def _extra(info: dict[str, Any]) -> str:
    return "; ".join(f"{k} = {v}" for k, v in info.items()) if info else ""


def _pytest_provenance(doc: dict[str, Any]) -> list[str]:
    """The command, time and machine of a pytest-benchmark JSON."""
    ours = doc.get("refserve") or {}
    mi = doc.get("machine_info", {})
    # pytest-benchmark's own record, where the run predates tests/bench/conftest.py's.
    machine = ours.get("machine") or {
        "cpu_model": (mi.get("cpu") or {}).get("brand_raw", mi.get("processor", "unknown")),
        "cores": (mi.get("cpu") or {}).get("count", "?"),
        "platform": f"{mi.get('system', '')} {mi.get('release', '')}".strip() or "unknown OS",
        "python": mi.get("python_version", "?"),
        "torch": None,
    }
    load_after = " / ".join(f"{x:.2f}" for x in ours.get("load_after", []))
    extra = f" Load average {load_after} at the end." if load_after else ""
    command = str(ours.get("command") or "python -m pytest (command not recorded)")
    when = str(doc.get("datetime", ""))[:16].replace("T", " ")
    return _provenance(command, f"{when} UTC" if when else "", machine, extra)


def _pytest_body(doc: dict[str, Any]) -> list[str]:
    lines = _pytest_provenance(doc)
    lines += [
        "pytest-benchmark's statistics of the time per round, per benchmark, with what the "
        "benchmark recorded itself (`extra_info`).",
        "",
    ]
    groups: dict[str, list[dict[str, Any]]] = {}
    for b in doc["benchmarks"]:
        group = b.get("group") or str(b.get("fullname", "")).split("::")[0]
        groups.setdefault(group, []).append(b)
    for group, items in groups.items():
        lines += [
            f"**{group}**",
            "",
            "| benchmark | median | min | mean | rounds | recorded |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for b in items:
            st = b["stats"]
            lines.append(
                f"| `{b['name']}` | {_seconds(st['median'])} | {_seconds(st['min'])} | "
                f"{_seconds(st['mean'])} | {st['rounds']} | {_extra(b.get('extra_info', {}))} |"
            )
        lines.append("")
    return lines


def _migration_body(doc: dict[str, Any]) -> list[str]:
    lines = _pytest_provenance(doc)
    for b in doc["benchmarks"]:
        lines += migration.table(b["extra_info"])
    return lines


def _gpu_body(doc: dict[str, Any]) -> list[str]:
    versions = f"torch {doc.get('torch', '?')}, Triton {doc.get('triton', '?')}"
    machine = (
        f"Device: {doc.get('device', 'not recorded')}, {versions}, Python "
        f"{doc.get('python', '?')}; a 1 GiB device-to-device copy measured "
        f"{doc.get('copy_bandwidth_gbs', '?')} GB/s in the same run."
    )
    note = doc.get("provenance_note")
    run = f"Command: `{doc.get('command', '')}`, run {doc.get('when', 'at an unrecorded time')}."
    shape = doc.get("shape", {})
    lines = [
        f"{run} {machine}" + (f" Provenance: {note}." if note else ""),
        "",
        f"Hq {shape.get('num_q_heads')} / Hkv {shape.get('num_kv_heads')} / D "
        f"{shape.get('head_size')}, block {shape.get('block_size')}; a mixed batch is the "
        f"decodes plus one {shape.get('chunk')}-token prefill chunk. Median of 20 CUDA-event "
        "timings after 3 warm-ups (SDPA: 10); ours and SDPA are timed one after the other "
        "in the same run, not interleaved. The bytes are the least the kernel must move "
        "(every live K/V slot once, queries, output); in brackets our time over SDPA's on "
        "the same data gathered densely (SDPA not charged for the paging). The error is the "
        "first sequence's against the oracle, checked before timing.",
        "",
        "| batch | context | sequences | dtype | time | GB/s | of the copy | SDPA time "
        "| ours / SDPA | max abs error |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc.get("rows", []):
        sdpa = "n/a" if r.get("sdpa_time_us") is None else f"{r['sdpa_time_us']:,.0f} us"
        ratio = "n/a" if r.get("ratio_to_sdpa") is None else f"[{r['ratio_to_sdpa']:.2f}x]"
        lines.append(
            f"| {r['kind']} | {r['context']:,} | {r['batch']} | {r['dtype']} "
            f"| {r['time_us']:,.0f} us | {r['bandwidth_gbs']:,.0f} | {r['fraction_of_copy']:.0%} "
            f"| {sdpa} | {ratio} | {r['max_abs_err_first_seq']:.1e} |"
        )
    notes = sorted({str(r["note"]) for r in doc.get("rows", []) if r.get("note")})
    lines += ["", *(f"Note: {n}." for n in notes), ""] if notes else [""]
    return lines


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _soak_pool(x: dict[str, Any]) -> str:
    """One replica's pools at the end of a soak."""
    rep = x["report"]
    if rep is None:
        return f"replica {x['replica']}: dead"
    return (
        f"replica {x['replica']}: {rep['free_blocks']} of {rep['num_blocks']} blocks free, "
        f"{rep['tables']} tables, {len(rep['live_requests'])} requests, "
        f"{len(rep['violations'])} violations"
    )


def _soak_body(doc: dict[str, Any]) -> list[str]:
    st, sm = doc["settings"], doc["summary"]
    load_after = " / ".join(f"{x:.2f}" for x in doc.get("load_after", []))
    extra = f" Load average {load_after} at the end." if load_after else ""
    note = f" Note: {doc['note']}." if doc.get("note") else ""
    lines = _provenance(str(doc["command"]), str(doc.get("when", "")), doc["machine"], extra)
    kinds = ", ".join(f"{n} {k}" for k, n in sm["kinds"].items())
    lo, hi = st["max_tokens"]
    lines += [
        f"{st['replicas']} replicas ({doc['backend']} backend), {st['duration_s']:g} s of "
        f"open-loop load at {st['rate_rps']:g} requests/s (seed {st['seed']}), {lo}-{hi} "
        f"output tokens each; a replica kill every {st['kill_every_s']:g} s on average. "
        f"Requests by kind: {kinds}.{note}",
        "",
        f"**{'Passed' if doc['passed'] else 'FAILED'}**"
        + ("." if doc["passed"] else ": " + "; ".join(doc["failures"])),
        "",
    ]
    ends, srv = sm["ends"], sm["server"]
    growth = ", ".join(f"{v:g} MiB" for v in sm["rss_growth_mib"].values()) or "no sample"
    pools = "; ".join(_soak_pool(x) for x in sm["final_pools"])
    p50, p99 = sm["ok_e2e_p50_s"], sm["ok_e2e_p99_s"]
    rows = [
        ("requests ended", f"{sum(ends.values())} of {sm['requests']}"),
        (
            "how they ended",
            f"{ends['ok']} with a result, {ends['error']} with a typed error, {ends['left']} "
            f"left by their client, {ends['refused']} refused (bad on purpose), "
            f"{ends['broken']} otherwise",
        ),
        ("typed errors", ", ".join(f"{k}: {n}" for k, n in sm["errors"].items()) or "none"),
        ("throughput", f"{sm['throughput_rps']:g} requests/s, {sm['tokens_per_s']:g} tokens/s"),
        ("goodput", f"{sm['goodput_rps']:g} requests/s (a result within {st['slo_e2e_s']:g} s)"),
        ("latency of a result", "n/a" if p50 is None else f"P50 {p50:g} s, P99 {p99:g} s"),
        (
            "error budget used",
            f"{_pct(sm['error_budget_used'])} (errors {_pct(sm['error_rate'])} of the requests "
            f"kept; budget {_pct(st['error_budget'])})",
        ),
        (
            "faults",
            f"{sm['kills_sent']} kills; {srv.get('replica_deaths_total', 0):g} deaths, "
            f"{srv.get('replica_restarts_total', 0):g} restarts, "
            f"{srv.get('replica_failed_requests_total', 0):g} requests failed with their "
            f"replica, {srv.get('replica_restarted_requests_total', 0):g} added again "
            f"elsewhere, {srv.get('aborted_requests', 0):g} aborted by the server",
        ),
        (
            "memory",
            f"peak RSS {sm['rss_peak_mib']:g} MiB; growth after the warm-up ("
            f"{_pct(st['warmup_fraction'])} of the run) {growth}, bound "
            f"{st['rss_bound_mib']:g} MiB",
        ),
        ("pools at the end", pools or "no replica"),
    ]
    lines += ["| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    return lines


KINDS: dict[str, Kind] = {
    k.key: k
    for k in (
        Kind(
            "step",
            "refserve's step: the bulk path against the reference loop",
            "make bench",
            _peers_body,
            "The full CPU step on the bulk path (the persistent batch: docs/ARCHITECTURE.md, "
            '"The persistent batch") against the same scheduler with `fast_decode=False`, the '
            "per-request reference loop the differential test holds it to, each in a worker "
            "process of its own; the ratio in brackets is the reference loop's time over the "
            "bulk path's.",
        ),
        Kind(
            "memory",
            "Python heap per running request",
            "make bench",
            _memory_body,
            "What N decoding requests hold, and what one step allocates, per request: "
            "nothing a step allocates may grow faster than N.",
        ),
        Kind(
            "pytest",
            "pytest-benchmark suites (`tests/bench/`)",
            "make bench",
            _pytest_body,
            "The pool's operations at two pool sizes (the work per block must not grow with "
            "the pool), the step, the engine and the simulator's scaling, as far as the "
            "command below ran them.",
        ),
        Kind(
            "migration",
            "Migration: sending the K/V against recomputing it",
            "make bench",
            _migration_body,
            "What a move of a request to another engine costs with its K/V, against the "
            "prefill the destination runs when the K/V stays behind, per context length "
            '(docs/MIGRATION.md, "The cost rule").',
        ),
        Kind(
            "gpu",
            "Paged attention on a GPU",
            "make gpu-bench",
            _gpu_body,
            "Our Triton paged-attention kernel (`refserve.kernels.paged_attention`, compiled) on "
            "decode and mixed batches from 1k to 128k context, against the practical "
            'bandwidth ceiling and against SDPA (docs/KERNELS.md, "GPU runs and the GPU '
            'benchmark").',
        ),
        Kind(
            "ab",
            "Before and after a change",
            "python -m refserve.conformance.bench.ab",
            _ab_body,
            "The pytest-benchmark suites in two checkouts (the code before a change and "
            "after it), rounds interleaved, the order alternating; the ratio is of the "
            "medians over rounds of each benchmark's median (above 1: slower after).",
        ),
        Kind(
            "simfit",
            "The simulator against the server it was fitted to",
            "make bench-simfit",
            _simfit_body,
            "`refserve serve` with one replica and with two, each loaded by `bench-serve "
            "--fit`: the fit (the step's terms by median regression, the loop's time "
            "between steps, the step's scatter, the time around the engine per request, "
            "each later token's delivery to the handler; ref/serve/fit.py) and the "
            "simulator's error on the same requests. A measured "
            "P99 rests on a few requests: its 90 % interval (the run's requests "
            "resampled) is the yardstick of its error.",
        ),
        Kind(
            "soak",
            "Soak: the served cluster under faults",
            "make soak",
            _soak_body,
            "`refserve serve --replicas 2` under open-loop load with replica kills (and "
            "their restarts), clients that disconnect mid-stream or give up, and bad "
            "requests, at moments drawn from a seed; it passes when every request ended "
            "exactly once with a result or a typed error, every surviving replica's pools "
            "pass the spec's checks with every block free at the end, the resident memory "
            'stays within its bound and the error budget holds (docs/CLUSTER.md, "Soak").',
        ),
        Kind(
            "peers",
            "refserve, nano-vllm-fork and vLLM side by side",
            "make bench-peers",
            _peers_body,
            "The same decode-heavy workload through each engine's scheduler, each in a worker "
            "in its own venv, rounds interleaved; each engine's timed step covers different "
            "work, listed under the table.",
        ),
    )
}


# --------------------------------------------------------------------- the document
def display(path: Path) -> str:
    """The path as the document names it: from the repository root when inside it, so
    the text does not depend on where the command ran."""
    p = path.resolve()
    try:
        return p.relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def render(inputs: Sequence[tuple[str, dict[str, Any]]], out: str) -> str:
    """The whole document for ``inputs`` ((display path, JSON) of known kinds), which is
    to be written to ``out``; sections in :data:`KINDS` order, then by path."""
    rank = {k: i for i, k in enumerate(KINDS)}
    docs = []
    for name, doc in inputs:
        key = kind_of(doc)
        if key is None:
            raise ValueError(f"{name}: not a benchmark JSON")
        docs.append((rank[key], name, KINDS[key], doc))
    docs.sort(key=lambda d: (d[0], d[1]))
    names = sorted(name for _, name, _, _ in docs)
    command = "python -m refserve.conformance.bench.report --out " + " ".join(
        shlex.quote(a) for a in (out, *names)
    )
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated file: do not edit. Regenerate with `make bench` / `make bench-peers`. -->",
        "",
        f"**Generated** by `{command}` from the benchmarks' own JSON; do not edit it by "
        "hand. `make bench`, `make bench-peers`, `make gpu-bench` and `make soak` measure, "
        "copy their JSON into `docs/bench/` and regenerate this file; "
        "`tests/repo/test_benchmarks_doc.py` fails when it differs from what that JSON renders.",
        "",
        "Each section names the command that measured it and the machine it ran on, as "
        "recorded when it ran. The machines are shared VMs whose speed moves with their "
        "load, so read a ratio measured in one run (in brackets) before an absolute figure, "
        "and do not compare absolute figures across sections.",
        "",
    ]
    lines += [f"- [{kind.title}](#{_slug(kind.title)}) (`{kind.make}`)" for _, _, kind, _ in docs]
    missing = [k for k in KINDS.values() if all(k is not kind for _, _, kind, _ in docs)]
    if missing:
        lines += ["", "Not measured for this file (no JSON among the inputs):", ""]
        lines += [f"- {k.title} (`{k.make}`)" for k in missing]
    lines.append("")
    for _, name, kind, doc in docs:
        lines += [f"## {kind.title}", ""]
        lines += [f"{kind.intro} From `{name}` (`{kind.make}`).".lstrip(), ""]
        lines += kind.render(doc)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading (as tests/repo/test_self_contained.py computes it)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def load(paths: Sequence[Path], log: Callable[[str], None]) -> list[tuple[str, dict[str, Any]]]:
    """The benchmark JSON among ``paths``; anything else is skipped with one line."""
    out = []
    for path in paths:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read JSON: {e}") from None
        if kind_of(doc) is None:
            log(f"report: skipped {path}: not a benchmark JSON")
            continue
        out.append((display(path), doc))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m refserve.conformance.bench.report",
        description="Render docs/BENCHMARKS.md from the benchmarks' JSON.",
    )
    p.add_argument("--out", type=Path, required=True, help="the markdown file to write")
    p.add_argument("inputs", type=Path, nargs="+", metavar="JSON")
    args = p.parse_args(argv)
    try:
        # Refused before anything is read: a directory, or a device such as /dev/null
        # that the atomic rename below would replace.
        check_output_file(args.out, "--out")
    except OutputPathError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    try:
        inputs = load(args.inputs, lambda line: print(line, file=sys.stderr))
        if not inputs:
            raise ValueError("no benchmark JSON among the inputs")
        text = render(inputs, display(args.out))
    except (ValueError, KeyError, TypeError) as e:
        # A JSON that claims a known format but lacks its fields is the writer's bug or a
        # hand edit: one line, and the old document stays as it was.
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, args.out)  # never a half-written document
    print(f"report: wrote {display(args.out)} from {len(inputs)} JSON file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
