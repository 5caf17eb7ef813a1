"""The kernel grid: named paged-attention cases run against the dense oracle.

DESIGN.md ("Kernels") lists the edge cases a paged-attention kernel gets wrong; each is a
:class:`GridCase` here. A case builds its inputs deterministically from a seed
(:func:`build_inputs`) in the vLLM-style layout (``kernels.validation``), with traps:

- physical blocks are shuffled (non-contiguous) and the pool holds spare blocks;
- every cache slot that is not live (past a sequence's length, in spare blocks) is NaN,
  and every unused block-table entry points at an all-NaN block, so a kernel that reads
  any of them produces NaN and fails loudly;
- if the function accepts an ``out=`` tensor, it gets a strided view into a larger
  buffer filled with a canary value, and any write outside the view fails the case.

:func:`run_grid` runs any function with the DESIGN.md signature over the grid and returns
one :class:`CaseResult` per (case, dtype), compared with ``kernels.oracle.paged_attention``
under the tolerances of ``kernels.tolerances``. :func:`check_kernel_main` is the
``refserve check-kernel MODULE:FUNCTION`` command. This module needs torch and
``kernels.oracle`` only (no triton), as DESIGN.md's dependency rule asks.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any, Protocol

import torch

from kernels import oracle
from kernels.tolerances import attention_tolerance

__all__ = [
    "GRID",
    "AttentionInputs",
    "CaseResult",
    "GridCase",
    "PagedAttentionFn",
    "build_inputs",
    "check_kernel_main",
    "format_table",
    "report_json",
    "run_grid",
    "select_cases",
]

#: Value written around the ``out=`` view; a kernel that writes outside it changes it.
CANARY = 12345.0


class PagedAttentionFn(Protocol):
    """The DESIGN.md signature every kernel under test has."""

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        scale: float | None = ...,
        sliding_window: int | None = ...,
        softcap: float | None = ...,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class GridCase:
    """One batch shape. ``seqs`` holds ``(context_len, q_len)`` per sequence.

    ``context_len`` tokens are already in the cache; this step adds ``q_len`` queries, so
    the KV length is ``context_len + q_len`` (``seq_lens``). ``q_len == 1`` is a decode,
    ``context_len == 0`` a whole prompt, anything else a mid-prompt chunk.
    ``logit_scale`` multiplies the queries (large values give extreme logits).
    ``num_blocks`` forces a large pool whose *last* blocks hold the data (int32 offset
    overflow); ``gpu_only`` cases are too big for the interpreter.
    """

    name: str
    seqs: tuple[tuple[int, int], ...]
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    sliding_window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    logit_scale: float = 1.0
    quick: bool = False
    gpu_only: bool = False
    num_blocks: int | None = None
    spare_blocks: int = 2

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(q for _, q in self.seqs)

    @property
    def shape(self) -> str:
        """Compact description for the report: sizes and (context+q) per sequence."""
        seqs = ",".join(f"{c}+{q}" for c, q in self.seqs)
        extras = ""
        if self.sliding_window is not None:
            extras += f" win={self.sliding_window}"
        if self.softcap is not None:
            extras += f" cap={self.softcap:g}"
        if self.scale is not None:
            extras += f" scale={self.scale:g}"
        if self.logit_scale != 1.0:
            extras += f" qx{self.logit_scale:g}"
        if self.num_blocks is not None:
            extras += f" blocks={self.num_blocks}"
        return (
            f"T={self.num_tokens} Hq={self.num_q_heads} Hkv={self.num_kv_heads} "
            f"D={self.head_size} bs={self.block_size} seqs=[{seqs}]{extras}"
        )


@dataclass(frozen=True)
class AttentionInputs:
    """Arguments of one ``paged_attention`` call, in DESIGN.md order."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float | None
    sliding_window: int | None
    softcap: float | None

    def call(self, fn: Callable[..., torch.Tensor], **extra: Any) -> torch.Tensor:
        """Call ``fn`` with these inputs as DESIGN.md orders them, plus ``extra`` keywords."""
        return fn(
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
            scale=self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            **extra,
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_inputs(
    case: GridCase, dtype: torch.dtype, device: torch.device | str, seed: int
) -> AttentionInputs:
    """Deterministic inputs for ``case`` (same seed, same tensors), with the traps above."""
    gen = torch.Generator().manual_seed(seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_size
    blocks_per_seq = [_cdiv(kv, bs) for kv in case.kv_lens]
    needed = sum(blocks_per_seq) + case.spare_blocks + 1  # + 1: the all-NaN padding block
    num_blocks = max(needed, case.num_blocks or 0)
    # The data lives in the pool's last `needed` blocks, in shuffled order.
    physical = (num_blocks - needed) + torch.randperm(needed, generator=gen)
    poison_block = int(physical[-1])
    max_blocks = max(blocks_per_seq, default=0) + 1  # >= 1 unused entry per row
    table = torch.full((len(case.seqs), max_blocks), poison_block, dtype=torch.int32)

    key_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype, device=device)
    value_cache = torch.full_like(key_cache, float("nan"))
    next_block = 0
    for s, kv_len in enumerate(case.kv_lens):
        ids = physical[next_block : next_block + blocks_per_seq[s]]
        next_block += blocks_per_seq[s]
        table[s, : len(ids)] = ids.to(torch.int32)
        # Live slots only: positions < kv_len, through the block table.
        pos = torch.arange(kv_len)
        blk, off = ids[pos // bs].to(device), (pos % bs).to(device)
        key_cache[blk, off] = torch.randn(kv_len, hkv, d, generator=gen).to(dtype).to(device)
        value_cache[blk, off] = torch.randn(kv_len, hkv, d, generator=gen).to(dtype).to(device)

    query = torch.randn(case.num_tokens, case.num_q_heads, d, generator=gen) * case.logit_scale
    starts = [0]
    for _, q_len in case.seqs:
        starts.append(starts[-1] + q_len)
    return AttentionInputs(
        query=query.to(dtype).to(device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=table.to(device),
        seq_lens=torch.tensor(case.kv_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=case.scale,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
    )


def _grid() -> tuple[GridCase, ...]:
    mixed = ((20, 1), (0, 9), (13, 6), (40, 1))  # decode, prompt, mid-chunk, decode
    cases = [
        # KV length around block boundaries (block 16): 1, bs - 1, bs, bs + 1, 3 bs - 6.
        GridCase("kv_len_1", ((0, 1),), 2, 1, 64, 16, quick=True),
        GridCase("kv_len_bs_minus_1", ((14, 1),), 2, 1, 64, 16),
        GridCase("kv_len_bs", ((15, 1),), 2, 1, 64, 16, quick=True),
        GridCase("kv_len_bs_plus_1", ((16, 1),), 2, 1, 64, 16, quick=True),
        GridCase("kv_len_3bs_minus_6", ((41, 1),), 2, 1, 64, 16, quick=True),
        GridCase("prompt_bs_plus_1", ((0, 17),), 2, 1, 64, 16),
        # Head sizes: 80 and 96 are not powers of two, 40 not a multiple of 16.
        GridCase("head_64", ((5, 3), (17, 1)), 2, 1, 64, 16),
        GridCase("head_80", ((5, 3), (17, 1)), 2, 1, 80, 16),
        GridCase("head_96", ((5, 3), (17, 1)), 2, 1, 96, 16),
        GridCase("head_128", ((5, 3), (17, 1)), 2, 1, 128, 16),
        GridCase("head_40", ((5, 3), (17, 1)), 2, 1, 40, 16, quick=True),
        # Block sizes 1, 5, 16, 32 on the mixed batch.
        GridCase("block_1", mixed, 2, 1, 32, 1),
        GridCase("block_5", mixed, 2, 1, 32, 5, quick=True),
        GridCase("block_16", mixed, 2, 1, 32, 16),
        GridCase("block_32", mixed, 2, 1, 32, 32),
        # GQA: query heads per KV head 1, 2, 5, 7, 8 (two KV heads for some).
        GridCase("gqa_1", mixed, 2, 2, 32, 16),
        GridCase("gqa_2", mixed, 4, 2, 32, 16),
        GridCase("gqa_5", mixed, 5, 1, 32, 16, quick=True),
        GridCase("gqa_7", mixed, 14, 2, 32, 16),
        GridCase("gqa_8", mixed, 8, 1, 32, 16),
        # Decode, whole prompts and mid-prompt chunks in one call, more sequences.
        GridCase(
            "mixed_batch",
            ((0, 1), (31, 1), (0, 23), (9, 7), (16, 16), (47, 2)),
            4,
            2,
            48,
            8,
            quick=True,
        ),
        # Options.
        GridCase("sliding_window_7", mixed, 4, 2, 32, 4, sliding_window=7, quick=True),
        GridCase("sliding_window_1", mixed, 2, 1, 32, 4, sliding_window=1),
        GridCase("softcap_5", mixed, 2, 1, 32, 16, softcap=5.0, logit_scale=4.0, quick=True),
        GridCase("window_and_softcap", mixed, 4, 2, 32, 5, sliding_window=10, softcap=20.0),
        GridCase("custom_scale", mixed, 4, 2, 32, 16, scale=0.37),
        # Scores of tens: softmax is sharp but not one-hot, so score errors show.
        GridCase("large_logits", mixed, 2, 1, 64, 16, logit_scale=12.0),
        # Scores in the hundreds: exp overflows fp32 past 88 without the max shift.
        GridCase("extreme_logits", mixed, 2, 1, 64, 16, logit_scale=100.0, quick=True),
        # A longer decode, where split-KV kernels split.
        GridCase("long_decode", ((300, 1), (129, 1)), 4, 1, 64, 16, quick=True),
        # More than 2**31 cache elements, data in the last blocks: int32 offsets overflow.
        GridCase(
            "int32_offset_overflow",
            ((40, 1), (7, 9)),
            2,
            1,
            128,
            16,
            num_blocks=(1 << 31) // (16 * 128) + 64,
            gpu_only=True,
        ),
    ]
    return tuple(cases)


#: The grid, in report order.
GRID: tuple[GridCase, ...] = _grid()


@dataclass(frozen=True)
class CaseResult:
    """Outcome of one (case, dtype) run; ``error`` says why it failed, if it did."""

    case: str
    shape: str
    dtype: str
    device: str
    max_abs_err: float
    tolerance: float
    passed: bool
    error: str | None = None


def select_cases(
    device: torch.device | str, *, quick: bool = False, cases: Sequence[GridCase] = GRID
) -> list[GridCase]:
    """Cases that run on ``device`` (GPU-only cases need CUDA), the quick subset if asked."""
    on_cuda = torch.device(device).type == "cuda"
    return [c for c in cases if (on_cuda or not c.gpu_only) and (c.quick or not quick)]


def _accepts_out(fn: Callable[..., torch.Tensor]) -> bool:
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def run_case(
    fn: Callable[..., torch.Tensor],
    case: GridCase,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    seed: int = 0,
) -> CaseResult:
    """Run ``fn`` on one case and compare with the oracle; exceptions become failures."""
    dev = torch.device(device)
    tol = attention_tolerance(dtype, dev)
    inputs = build_inputs(case, dtype, dev, seed ^ zlib.crc32(case.name.encode()))
    ref = inputs.call(oracle.paged_attention).float()
    bound = tol.bound(float(ref.abs().max()) if ref.numel() else 0.0)

    def result(err: float, error: str | None) -> CaseResult:
        passed = error is None and err <= bound
        return CaseResult(
            case.name, case.shape, str(dtype).removeprefix("torch."), str(dev), err, bound, passed,
            error,
        )  # fmt: skip

    t, hq, d = inputs.query.shape
    buffer = None
    extra: dict[str, Any] = {}
    if _accepts_out(fn):
        # One extra token row and three extra columns per head around the view.
        buffer = torch.full((t + 1, hq, d + 3), CANARY, dtype=dtype, device=dev)
        extra["out"] = buffer[:t, :, :d]
    try:
        out = inputs.call(fn, **extra)
    except Exception as exc:  # a kernel under test may raise anything; report it
        return result(math.nan, f"raised {type(exc).__name__}: {exc}")
    if not isinstance(out, torch.Tensor) or out.shape != inputs.query.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return result(math.nan, f"returned {shape}, expected shape {tuple(inputs.query.shape)}")
    if out.dtype != dtype:
        return result(math.nan, f"returned dtype {out.dtype}, expected {dtype}")
    diff = (out.float() - ref).abs()
    err = float(diff.max()) if diff.numel() else 0.0
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        return result(math.nan, f"{bad} non-finite outputs (a read of a NaN-poisoned slot?)")
    if buffer is not None:
        outside = buffer.clone()
        outside[:t, :, :d] = CANARY
        if not bool((outside == CANARY).all()):
            return result(err, "wrote outside its output view (canary changed)")
    return result(err, None)


def run_grid(
    fn: Callable[..., torch.Tensor],
    *,
    device: torch.device | str,
    dtypes: Sequence[torch.dtype],
    cases: Sequence[GridCase] | None = None,
    quick: bool = False,
    seed: int = 0,
) -> list[CaseResult]:
    """Run ``fn`` over ``cases`` (default: the grid for ``device``) x ``dtypes``."""
    chosen = select_cases(device, quick=quick) if cases is None else list(cases)
    return [run_case(fn, c, dt, device, seed=seed) for c in chosen for dt in dtypes]


def report_json(results: Sequence[CaseResult], *, target: str = "") -> dict[str, Any]:
    """A JSON-able report: the target, a summary and one record per result.

    Non-finite errors (NaN, inf) become ``null``: strict JSON has no NaN.
    """

    def record(r: CaseResult) -> dict[str, Any]:
        row = asdict(r)
        row["max_abs_err"] = r.max_abs_err if math.isfinite(r.max_abs_err) else None
        return row

    failed = [r.case + "/" + r.dtype for r in results if not r.passed]
    return {
        "target": target,
        "layout": "vllm",
        "total": len(results),
        "passed": len(results) - len(failed),
        "failed": failed,
        "results": [record(r) for r in results],
    }


def format_table(results: Sequence[CaseResult]) -> str:
    """A plain-text table: case, shape, dtype, max abs error, tolerance, PASS/FAIL."""
    header = ("case", "shape", "dtype", "max abs err", "tolerance", "result")
    rows = [
        (
            r.case,
            r.shape,
            r.dtype,
            f"{r.max_abs_err:.2e}",
            f"{r.tolerance:.2e}",
            "PASS" if r.passed else "FAIL" + (f": {r.error}" if r.error else ""),
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]

    def line(row: Sequence[str]) -> str:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
        return "  ".join([*cells, row[-1]]).rstrip()

    passed = sum(r.passed for r in results)
    return "\n".join(
        [line(header), line(["-" * w for w in widths] + ["------"])]
        + [line(row) for row in rows]
        + [f"{passed}/{len(results)} passed"]
    )


_DTYPES = MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)


def _load_function(target: str) -> Callable[..., torch.Tensor]:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FUNCTION, got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{target} is not callable")
    fn: Callable[..., torch.Tensor] = obj
    return fn


def check_kernel_main(argv: list[str]) -> int:
    """``refserve check-kernel MODULE:FUNCTION [--layout vllm] [--json OUT] [--quick]``.

    Runs the grid against ``kernels.oracle.paged_attention``, prints the table, writes the
    JSON report if asked; returns 0 iff every case passed (2 on a usage error).
    """
    parser = argparse.ArgumentParser(
        prog="refserve check-kernel",
        description="Check a paged-attention kernel against the dense oracle over the "
        "kernel grid (DESIGN.md, Kernels).",
    )
    parser.add_argument("target", help="MODULE:FUNCTION with the DESIGN.md signature")
    parser.add_argument("--layout", choices=["vllm"], default="vllm", help="cache layout")
    parser.add_argument("--json", dest="json_path", help="write the JSON report here")
    parser.add_argument("--quick", action="store_true", help="run the quick subset")
    parser.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    parser.add_argument(
        "--dtype",
        action="append",
        choices=sorted(_DTYPES),
        help="repeatable; default float32, float16 (+ bfloat16 on cuda)",
    )
    parser.add_argument("--seed", type=int, default=0)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return exc.code if isinstance(exc.code, int) else 2

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and "TRITON_INTERPRET" not in os.environ:
        # Triton kernels run on CPU tensors only in interpreter mode, which must be on
        # before the kernel's module is imported (DESIGN.md, Kernels).
        os.environ["TRITON_INTERPRET"] = "1"
        print("note: CPU run; TRITON_INTERPRET=1 set for Triton kernels", file=sys.stderr)
    try:
        fn = _load_function(args.target)
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"refserve check-kernel: cannot load {args.target}: {exc}", file=sys.stderr)
        return 2
    if args.dtype:
        dtypes = [_DTYPES[name] for name in args.dtype]
    else:
        dtypes = [torch.float32, torch.float16]
        if device.type == "cuda":
            dtypes.append(torch.bfloat16)

    results = run_grid(fn, device=device, dtypes=dtypes, quick=args.quick, seed=args.seed)
    print(format_table(results))
    gpu_only = [c.name for c in GRID if c.gpu_only and device.type != "cuda"]
    if gpu_only:
        print(f"not run (need CUDA): {', '.join(gpu_only)}")
    if args.quick:
        print(f"quick subset: {len(select_cases(device, quick=True))} of {len(GRID)} cases")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(report_json(results, target=args.target), fh, indent=2)
            fh.write("\n")
    return 0 if results and all(r.passed for r in results) else 1


if __name__ == "__main__":  # python -m conformance.kernel_grid MODULE:FUNCTION ...
    sys.exit(check_kernel_main(sys.argv[1:]))
