"""The Python heap per running request, and what one step allocates (``make bench``).

Run::

    python -m refserve.conformance.bench.memory --json out/bench-memory.json --markdown
    out/bench-memory.md

The workload is ``make bench-peers``' (conformance/bench/workload.py: N running decodes,
block 16, prompts of 100-128 tokens, no preemption; 16 blocks of pool per request here),
on the bulk decode path with prefix caching off. tracemalloc measures, at N = 1024 and
16,384: the heap held once every request decodes (the requests and their token lists,
the pool's tables and free queue, the persistent batch's rows), per running request;
and the peak one full CPU step (``schedule`` + ``build_inputs`` + ``commit``) allocates
above what it started with, per running request: the plan, the input tensors and the
per-step lists, all freed again when the step's objects go.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from refserve.conformance.bench import workload as W
from refserve.conformance.bench.machine import Provenance, machine_line
from refserve.core.config import SchedulerConfig
from refserve.core.inputs import build_inputs
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler

SIZES = (1024, 16384)
BLOCKS_PER_REQUEST = 16  # 256 tokens of pool each: room for the measured steps


def running(n: int) -> Scheduler:
    """N requests prefilled and decoding (the bench-peers workload, caching off)."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=max(2048, 2 * n),
        max_num_seqs=n,
        block_size=W.BLOCK_SIZE,
        num_blocks=n * BLOCKS_PER_REQUEST,
        enable_prefix_caching=False,
    )
    s = Scheduler(cfg)
    for i in range(n):
        stop = StopParams(max_tokens=W.MAX_TOKENS, ignore_eos=True)
        s.add_request(Request(W.request_id(i), W.prompt(i), stop))
    while s.waiting or any(r.num_output_tokens == 0 for r in s.running):
        plan = s.schedule()
        s.commit(plan, torch.full((sum(plan.samples),), W.PREFILL_TOKEN))
    if len(s.running) != n:
        raise RuntimeError(f"{len(s.running)} of {n} requests running after prefill")
    return s


def step(s: Scheduler) -> None:
    plan = s.schedule()
    inputs = build_inputs(plan, s.requests, s.pool, s.batch)
    s.commit(plan, torch.full((len(inputs.sample_request_ids),), W.SAMPLED))


@dataclass(frozen=True)
class MemoryFigure:
    n: int
    heap_bytes_per_request: int  # held while N requests decode
    step_bytes_per_request: int  # peak a step allocates above what it started with


def measure(n: int) -> MemoryFigure:
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        s = running(n)
        step(s)  # the batch's arrays at their size
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        peaks = []
        for _ in range(5):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            step(s)
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    if len(s.running) != n:
        raise RuntimeError(f"a measured step finished or preempted a request (N={n})")
    return MemoryFigure(n, held // n, int(statistics.median(peaks)) // n)


FORMAT = "refserve-bench-memory"


def table(figures: list[MemoryFigure]) -> list[str]:
    """The figures as a markdown table (also what ``refserve.conformance.bench.report`` prints)."""
    lines = [
        "| N | heap held per running request | peak a step allocates, per running request |",
        "|---|---|---|",
    ]
    for f in figures:
        lines.append(f"| {f.n} | {f.heap_bytes_per_request:,} B | {f.step_bytes_per_request:,} B |")
    return lines


def markdown(figures: list[MemoryFigure], when: str, machine: dict[str, Any]) -> str:
    lines = [
        "# refserve: Python heap per running request (tracemalloc)",
        "",
        f"{when}. Bulk decode path, prefix caching off, block {W.BLOCK_SIZE}, prompts of "
        f"{W.MIN_PROMPT}-{W.MAX_PROMPT} tokens. {machine_line(machine)}.",
        "",
        *table(figures),
    ]
    return "\n".join(lines) + "\n"


def figures_of(doc: dict[str, Any]) -> list[MemoryFigure]:
    """The figures of a JSON document :func:`main` wrote."""
    if doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} JSON (format {doc.get('format')!r})")
    return [
        MemoryFigure(
            int(f["n"]), int(f["heap_bytes_per_request"]), int(f["step_bytes_per_request"])
        )
        for f in doc["figures"]
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m refserve.conformance.bench.memory", description=__doc__
    )
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), metavar="N")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    if any(n < 1 for n in args.sizes):
        p.error("every size must be >= 1")
    provenance = Provenance.start(
        "python -m refserve.conformance.bench.memory "
        + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    )
    figures = []
    for n in args.sizes:
        f = measure(n)
        figures.append(f)
        print(
            f"N={n}: {f.heap_bytes_per_request:,} B of heap per running request; a step "
            f"allocates at most {f.step_bytes_per_request:,} B per request",
            flush=True,
        )
    doc = {
        **provenance.header(FORMAT),
        "workload": {
            "block_size": W.BLOCK_SIZE,
            "prompt_tokens": [W.MIN_PROMPT, W.MAX_PROMPT],
            "blocks_per_request": BLOCKS_PER_REQUEST,
            "prefix_caching": False,
        },
        "figures": [asdict(f) for f in figures],
    }
    for path, text in (
        (args.json, json.dumps(doc, indent=2)),
        (args.markdown, markdown(figures, provenance.when, provenance.machine)),
    ):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
