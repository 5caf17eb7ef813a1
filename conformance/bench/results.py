"""What one ``bench-peers`` run measured (:class:`Run`), its figures and its JSON.

A cell is one engine on one configuration, holding the raw per-round times; every
figure (the median per running request or per block), ratio to refserve and growth is
computed from those times on demand, so a run read back from its JSON
(:meth:`Run.from_json`) gives exactly the figures the run itself printed. The driver
(:mod:`refserve.conformance.bench.peers`) fills a :class:`Run`;
:mod:`refserve.conformance.bench.render` and :mod:`refserve.conformance.bench.report` turn one into
markdown.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from refserve.conformance.bench import workload as W

BASELINE = "ref"
"""The engine every ratio is taken against."""


@dataclass
class Cell:
    """One engine on one configuration."""

    engine: str
    n: int
    prefix_caching: bool
    status: str = "ok"
    """``ok``, ``unsupported`` (the engine has no such configuration) or ``error``."""
    reason: str = ""
    setup_s: float = 0.0
    times_ns: list[list[int]] = field(default_factory=list)
    """Per round: the step's phases in nanoseconds."""

    @property
    def key(self) -> str:
        return W.Shape(self.n, self.prefix_caching).key


@dataclass
class PoolCell(Cell):
    """One engine's block pool on one configuration; ``n`` is ``POOL_K`` (blocks per
    round), so :func:`per_request_us` of its rounds is microseconds per block."""

    hashing: str = "same"
    """``same`` (refserve's block_key in both engines) or ``native`` (vLLM's own)."""

    @property
    def key(self) -> str:
        return W.pool_key(self.prefix_caching, self.hashing)


POOL_CONFIGS: tuple[tuple[bool, str], ...] = ((False, "same"), (True, "same"), (True, "native"))
"""(prefix caching, hashing) of each block-pool configuration, in table order."""


def pool_figure(
    cells: Sequence[PoolCell], engine: str, caching: bool, hashing: str
) -> float | None:
    """The engine's us per block on that pool configuration (None: not measured)."""
    for c in cells:
        if (c.engine, c.prefix_caching, c.hashing) == (engine, caching, hashing):
            if c.status == "ok" and c.times_ns:
                return per_request_us(c.times_ns, c.n)
            return None
    return None


def pool_ratio(cells: Sequence[PoolCell], engine: str, caching: bool, hashing: str) -> float | None:
    """The engine's figure over refserve's with the same prefix caching (refserve has one
    hashing, so vLLM's native hashing is set against it too)."""
    mine = pool_figure(cells, engine, caching, hashing)
    base = pool_figure(cells, BASELINE, caching, "same")
    if mine is None or base is None or base <= 0:
        return None
    return mine / base


def per_request_us(times_ns: Sequence[Sequence[int]], n: int) -> float:
    """The median over rounds of one step's time (its phases summed) per request, in us."""
    if not times_ns:
        raise ValueError("no rounds")
    return statistics.median(sum(t) for t in times_ns) / n / 1e3


def phase_us(times_ns: Sequence[Sequence[int]], n: int) -> list[float]:
    """Each phase's median over rounds, per request, in us."""
    if not times_ns:
        return []
    return [statistics.median(t[i] for t in times_ns) / n / 1e3 for i in range(len(times_ns[0]))]


def figure(cells: Sequence[Cell], engine: str, n: int, caching: bool) -> float | None:
    """The engine's us per request on that configuration (None: not measured)."""
    for c in cells:
        if (c.engine, c.n, c.prefix_caching) == (engine, n, caching):
            if c.status == "ok" and c.times_ns:
                return per_request_us(c.times_ns, n)
            return None
    return None


def ratio(cells: Sequence[Cell], engine: str, n: int, caching: bool) -> float | None:
    """The engine's figure over refserve's for the same configuration."""
    mine = figure(cells, engine, n, caching)
    base = figure(cells, BASELINE, n, caching)
    if mine is None or base is None or base <= 0:
        return None
    return mine / base


def growth(cells: Sequence[Cell], engine: str, caching: bool, sizes: Sequence[int]) -> float | None:
    """The figure at the largest N over the figure at the smallest."""
    if len(sizes) < 2:
        return None
    lo = figure(cells, engine, min(sizes), caching)
    hi = figure(cells, engine, max(sizes), caching)
    if lo is None or hi is None or lo <= 0:
        return None
    return hi / lo


def default_workload() -> dict[str, Any]:
    """The step workload as the JSON records it (the renderers read it from there, so a
    committed JSON still renders with the workload it was measured on)."""
    return {
        "block_size": W.BLOCK_SIZE,
        "prompt_tokens": [W.MIN_PROMPT, W.MAX_PROMPT],
        "blocks_per_request": W.BLOCKS_PER_REQUEST,
        "max_num_batched_tokens": "max(2048, 2 N)",
    }


def default_pool_workload() -> dict[str, Any]:
    return {
        "blocks": W.POOL_BLOCKS,
        "blocks_per_round": W.POOL_K,
        "block_size": W.BLOCK_SIZE,
        "timed_rounds_per_message": W.POOL_REPS,
    }


@dataclass
class Run:
    """Everything one ``bench-peers`` run measured."""

    command: str
    sizes: list[int]
    rounds: int
    warmup: int
    engines: dict[str, dict[str, Any]]
    """Per engine key: ``name``, ``includes``, ``phases``, ``python``, ``error``."""
    cells: list[Cell]
    started: str = ""
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    cpus: int = 0
    pinned_cpu: int | None = None
    """The one CPU every worker ran on (:func:`pinned`), or None: the OS placed them."""
    pool_cells: list[PoolCell] = field(default_factory=list)
    parts: tuple[str, ...] = ("steps", "pool")
    machine: dict[str, Any] = field(default_factory=dict)
    """:func:`refserve.conformance.bench.machine.describe` when the run started."""
    workload: dict[str, Any] = field(default_factory=default_workload)
    pool_workload: dict[str, Any] = field(default_factory=default_pool_workload)

    def to_json(self) -> dict[str, Any]:
        out_cells = []
        for c in self.cells:
            d: dict[str, Any] = {
                "engine": c.engine,
                "n": c.n,
                "prefix_caching": c.prefix_caching,
                "status": c.status,
            }
            if c.reason:
                d["reason"] = c.reason
            if c.status == "ok" and c.times_ns:
                d["us_per_request"] = round(per_request_us(c.times_ns, c.n), 3)
                phases = self.engines.get(c.engine, {}).get("phases", [])
                d["phase_us_per_request"] = dict(
                    zip(phases, (round(x, 3) for x in phase_us(c.times_ns, c.n)), strict=False)
                )
                r = ratio(self.cells, c.engine, c.n, c.prefix_caching)
                d["ratio_to_refserve"] = None if r is None else round(r, 3)
                d["setup_s"] = c.setup_s
                d["times_ns"] = c.times_ns
            out_cells.append(d)
        growths = {
            f"{e}-{'cache' if caching else 'nocache'}": (None if g is None else round(g, 3))
            for e in self.engines
            for caching in (False, True)
            for g in [growth(self.cells, e, caching, self.sizes)]
        }
        return {
            "format": "refserve-bench-peers",
            "version": 1,
            "command": self.command,
            "started": self.started,
            "load_before": self.load_before,
            "load_after": self.load_after,
            "cpus": self.cpus,
            "pinned_cpu": self.pinned_cpu,
            "machine": self.machine,
            "sizes": self.sizes,
            "rounds": self.rounds,
            "warmup": self.warmup,
            "workload": self.workload,
            "engines": self.engines,
            "cells": out_cells,
            "growth_largest_over_smallest_n": growths,
            "parts": list(self.parts),
            "pool": self._pool_json(),
        }

    def _pool_json(self) -> dict[str, Any]:
        cells = []
        for c in self.pool_cells:
            d: dict[str, Any] = {
                "engine": c.engine,
                "prefix_caching": c.prefix_caching,
                "hashing": c.hashing,
                "status": c.status,
            }
            if c.reason:
                d["reason"] = c.reason
            if c.status == "ok" and c.times_ns:
                d["us_per_block"] = round(per_request_us(c.times_ns, c.n), 4)
                r = pool_ratio(self.pool_cells, c.engine, c.prefix_caching, c.hashing)
                d["ratio_to_refserve"] = None if r is None else round(r, 3)
                d["setup_s"] = c.setup_s
                d["rounds_ns"] = [t[0] for t in c.times_ns]
            cells.append(d)
        return {**self.pool_workload, "cells": cells}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Run:
        """The run a :meth:`to_json` document describes, as far as rendering needs: the
        per-round times are kept, so every median and ratio is recomputed exactly as
        the run computed it (``refserve.conformance.bench.report`` renders committed JSON so)."""
        if d.get("format") != "refserve-bench-peers":
            raise ValueError(f"not a bench-peers JSON (format {d.get('format')!r})")
        cells = [_cell_from_json(c) for c in d.get("cells", [])]
        pool_workload, pool_cells = _pool_from_json(dict(d.get("pool") or {}))
        pinned = d.get("pinned_cpu")
        return cls(
            command=str(d.get("command", "")),
            sizes=[int(n) for n in d.get("sizes", [])],
            rounds=int(d.get("rounds", 0)),
            warmup=int(d.get("warmup", 0)),
            engines={str(e): dict(v) for e, v in dict(d.get("engines") or {}).items()},
            cells=cells,
            started=str(d.get("started", "")),
            load_before=[float(x) for x in d.get("load_before", [])],
            load_after=[float(x) for x in d.get("load_after", [])],
            cpus=int(d.get("cpus", 0)),
            pinned_cpu=None if pinned is None else int(pinned),
            pool_cells=pool_cells,
            parts=tuple(str(p) for p in d.get("parts", ("steps", "pool"))),
            machine=dict(d.get("machine") or {}),
            workload=dict(d.get("workload") or default_workload()),
            pool_workload=pool_workload or default_pool_workload(),
        )


def _cell_from_json(c: dict[str, Any]) -> Cell:
    return Cell(
        str(c["engine"]),
        int(c["n"]),
        bool(c["prefix_caching"]),
        str(c.get("status", "ok")),
        str(c.get("reason", "")),
        float(c.get("setup_s", 0.0)),
        [list(map(int, t)) for t in c.get("times_ns", [])],
    )


def _pool_from_json(pool: dict[str, Any]) -> tuple[dict[str, Any], list[PoolCell]]:
    """The block-pool part of a run's JSON: its workload (every key but ``cells``) and
    its cells, each round one figure for the whole round (the pool has no phases)."""
    workload = {k: v for k, v in pool.items() if k != "cells"}
    k = int(workload.get("blocks_per_round", W.POOL_K))
    cells = [
        PoolCell(
            str(c["engine"]),
            k,
            bool(c["prefix_caching"]),
            str(c.get("status", "ok")),
            str(c.get("reason", "")),
            float(c.get("setup_s", 0.0)),
            [[int(t)] for t in c.get("rounds_ns", [])],
            hashing=str(c.get("hashing", "same")),
        )
        for c in pool.get("cells", [])
    ]
    return workload, cells
