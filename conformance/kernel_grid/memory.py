"""The write_kv and copy_blocks cases (docs/KERNELS.md, "write_kv and copy_blocks"):
the kernel and the oracle run on identical copies of the inputs (built twice from the
seed), and the caches, the whole storage behind each view, must then match exactly."""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from refserve.conformance.kernel_grid.cases import GridCase
from refserve.conformance.kernel_grid.inputs import AttentionInputs, build_inputs, cdiv, empty_cache
from refserve.conformance.kernel_grid.results import PASS, CaseResult, Verdict
from refserve.kernels import oracle

#: (oracle's cache, kernel's cache) pairs that must match after the call.
_Pairs = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Call:
    """One memory-op call: the kernel's arguments (the oracle already ran on the twin
    inputs) and the cache pairs that must then be equal."""

    args: tuple[Any, ...]
    checked: _Pairs


def run_memory_case(
    fn: Callable[..., Any],
    case: GridCase,
    dtype: torch.dtype,
    dev: torch.device,
    seed: int,
    base: CaseResult,
    with_traceback: bool,
) -> CaseResult:
    """Run the oracle and ``fn`` on twin inputs and compare every cache they touched."""
    started = time.perf_counter()
    base = replace(base, tolerance=0.0, atol=0.0, rtol=0.0)  # copies are exact
    case_seed = seed ^ zlib.crc32(case.name.encode())
    ref_in = build_inputs(case, dtype, dev, case_seed)
    ker_in = build_inputs(case, dtype, dev, case_seed)
    gen = torch.Generator().manual_seed(case_seed + 1)
    prepare = _write_kv if case.op == "write_kv" else _copy_blocks
    call = prepare(case, ref_in, ker_in, dtype, dev, gen)
    try:
        fn(*call.args)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as exc:  # a kernel under test may raise anything; report it
        return Verdict.raised(exc, with_traceback).result(base, started)
    return _compare(call.checked).result(base, started)


def _compare(checked: _Pairs) -> Verdict:
    worst = 0.0
    for ref_cache, ker_cache in checked:
        equal, diff = _same(_storage(ref_cache), _storage(ker_cache))
        worst = max(worst, diff)
        if not equal:
            why = "a write to the wrong slot or outside the view?"
            return Verdict(f"caches differ from the oracle's ({why})", diff)
    return Verdict(max_abs_err=worst, status=PASS)


def _write_kv(
    case: GridCase,
    ref_in: AttentionInputs,
    ker_in: AttentionInputs,
    dtype: torch.dtype,
    dev: torch.device,
    gen: torch.Generator,
) -> _Call:
    """This step's tokens (and ``pad_tokens`` slot -1 rows) into their slots."""
    slots = _slots_of_step(case, ref_in)
    shape = (len(slots), case.num_kv_heads, case.head_size)
    key = torch.randn(shape, generator=gen).to(dtype).to(dev)
    value = torch.randn(shape, generator=gen).to(dtype).to(dev)
    index = torch.tensor(slots, dtype=torch.int32 if case.int32_index else torch.int64,
                         device=dev)  # fmt: skip
    oracle.write_kv(key, value, ref_in.key_cache, ref_in.value_cache, index)
    args = (key, value, _kernel_view(ker_in.key_cache, case.layout),
            _kernel_view(ker_in.value_cache, case.layout), index)  # fmt: skip
    return _Call(args, _caches(ref_in, ker_in))


def _copy_blocks(
    case: GridCase,
    ref_in: AttentionInputs,
    ker_in: AttentionInputs,
    dtype: torch.dtype,
    dev: torch.device,
    gen: torch.Generator,
) -> _Call:
    """Each sequence's last block to a spare block: copy-on-write within the pool, or a
    swap into a second pool (``two_pools``)."""
    table = ref_in.block_table.tolist()
    bs = case.block_size
    used = [table[s][cdiv(kv, bs) - 1] for s, kv in enumerate(case.kv_lens)]
    live = {b for s, kv in enumerate(case.kv_lens) for b in table[s][: cdiv(kv, bs)]}
    poison = table[0][-1]
    pool = _storage(ref_in.key_cache).shape[0]
    spare = [b for b in range(pool) if b not in live and b != poison]
    mapping = torch.tensor(list(zip(used, spare, strict=False)), dtype=torch.int64,
                           device=dev)  # fmt: skip
    ref_dst: tuple[torch.Tensor, ...] = (ref_in.key_cache, ref_in.value_cache)
    ker_dst: tuple[torch.Tensor, ...] = (ker_in.key_cache, ker_in.value_cache)
    if case.two_pools:
        n = ref_in.key_cache.shape[0]
        ref_dst = tuple(empty_cache(case, n, dtype, dev, case.head_size) for _ in "kv")
        ker_dst = tuple(empty_cache(case, n, dtype, dev, case.head_size) for _ in "kv")
    oracle.copy_blocks(ref_in.key_cache, ref_in.value_cache, ref_dst[0], ref_dst[1], mapping)
    args = (_kernel_view(ker_in.key_cache, case.layout),
            _kernel_view(ker_in.value_cache, case.layout),
            *(_kernel_view(c, case.layout) for c in ker_dst), mapping)  # fmt: skip
    return _Call(args, list(zip(ref_dst, ker_dst, strict=True)) + _caches(ref_in, ker_in))


def _caches(ref_in: AttentionInputs, ker_in: AttentionInputs) -> _Pairs:
    return [(ref_in.key_cache, ker_in.key_cache), (ref_in.value_cache, ker_in.value_cache)]


def _slots_of_step(case: GridCase, inputs: AttentionInputs) -> list[int]:
    """This step's slots: the last ``q_len`` positions of every sequence, through the
    block table, with ``pad_tokens`` slot -1 rows spread among them."""
    table = inputs.block_table.tolist()
    bs = case.block_size
    slots = [
        table[s][p // bs] * bs + p % bs
        for s, (ctx, q) in enumerate(case.seqs)
        for p in range(ctx, ctx + q)
    ]
    for i in range(case.pad_tokens):
        slots.insert((i * 7) % (len(slots) + 1), -1)
    return slots


def _same(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """Bitwise-equal up to NaN == NaN (copies are exact); and the max abs difference."""
    a64, b64 = a.to("cpu", torch.float64), b.to("cpu", torch.float64)
    both_nan = a64.isnan() & b64.isnan()
    equal = bool(((a64 == b64) | both_nan).all())
    diff = (a64 - b64).abs().masked_fill(both_nan, 0.0).nan_to_num(math.inf)
    return equal, float(diff.max()) if diff.numel() else 0.0


def _storage(cache: torch.Tensor) -> torch.Tensor:
    """The whole tensor a cache view was cut from (a write outside the view shows)."""
    return cache._base if cache._base is not None else cache


def _kernel_view(cache: torch.Tensor, layout: str) -> torch.Tensor:
    return cache.transpose(1, 2) if layout == "hnd" else cache
