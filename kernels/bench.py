"""``make gpu-bench``: paged-attention throughput on a CUDA GPU (docs/KERNELS.md, "GPU
benchmark").

For decode batches and mixed batches (decodes plus one prefill chunk) at 1k-128k context,
fp16 and bf16, block size 16, it times :func:`refserve.kernels.paged_attention` and reports

- achieved HBM bandwidth: the bytes the kernel must move at least (every live K/V slot
  once, the queries, the output) over its time, and that as a fraction of a measured
  device-to-device copy (``torch`` ``copy_`` of 1 GiB: the practical ceiling);
- the ratio of its time to ``torch.nn.functional.scaled_dot_product_attention`` on the
  same data, already gathered densely (so SDPA is not charged for paging);
- the ratio to FlashInfer's paged decode (``BatchDecodeWithPagedKVCacheWrapper``, NHD)
  for decode batches when ``flashinfer`` is importable; otherwise why not.

Everything goes into one JSON file. Sizes are picked so the whole run, compile included,
takes a couple of minutes: ``make gpu-check`` plus ``make gpu-bench`` fit in 10 minutes
on one GPU. Each configuration is checked against the oracle on its first sequence
before it is timed, so a fast wrong kernel cannot report a number.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

#: The ``format`` of the JSON this writes (``refserve.conformance.bench.report`` renders it).
FORMAT = "refserve-gpu-bench"
CONTEXTS = (1024, 4096, 16384, 65536, 131072)
BLOCK_SIZE = 16
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
#: Total KV tokens per decode batch: batch size = this // context (at least 1).
KV_TOKENS_PER_BATCH = 262144
#: Query tokens of the prefill chunk in a mixed batch.
CHUNK = 512


@dataclass(frozen=True)
class BenchRow:
    """One (kind, context, dtype) measurement; times in microseconds."""

    kind: str
    context: int
    batch: int
    dtype: str
    time_us: float
    bytes_moved: int
    bandwidth_gbs: float
    fraction_of_copy: float
    sdpa_time_us: float | None
    ratio_to_sdpa: float | None
    flashinfer_time_us: float | None
    ratio_to_flashinfer: float | None
    max_abs_err_first_seq: float
    note: str | None = None


def _time_us(fn: Callable[[], object], *, reps: int = 20, warmup: int = 3) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn``, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) * 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = _time_us(lambda: dst.copy_(src), reps=10)
    return 2 * nbytes / (us * 1e-6) / 1e9


def _batch(
    kind: str, context: int, dtype: torch.dtype, device: torch.device
) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    """Paged inputs (shuffled blocks) for ``kind`` at ``context``; and (ctx, q_len) per seq."""
    batch = max(1, KV_TOKENS_PER_BATCH // context)
    seqs = [(context - 1, 1)] * batch
    if kind == "mixed":
        seqs[-1] = (context - CHUNK, CHUNK)  # one prefill chunk ending at `context`
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = blocks_per_seq * len(seqs)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_table = perm.view(len(seqs), blocks_per_seq)
    num_tokens = sum(q for _, q in seqs)
    query = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_SIZE, generator=gen, device=device,
                        dtype=dtype)  # fmt: skip
    starts = [0]
    for _, q in seqs:
        starts.append(starts[-1] + q)
    inputs = {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_table": block_table,
        "seq_lens": torch.tensor([c + q for c, q in seqs], dtype=torch.int32, device=device),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=device),
    }
    return inputs, seqs


def _dense_kv(inputs: dict[str, torch.Tensor], s: int, kv_len: int) -> tuple[torch.Tensor, ...]:
    """Sequence ``s``'s K and V gathered densely as ``[1, Hkv, kv_len, D]``."""
    blocks = inputs["block_table"][s, : -(-kv_len // BLOCK_SIZE)].long()
    k = inputs["key_cache"][blocks].flatten(0, 1)[:kv_len]
    v = inputs["value_cache"][blocks].flatten(0, 1)[:kv_len]
    return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def _sdpa_fn(inputs: dict[str, torch.Tensor], seqs: list[tuple[int, int]]) -> Callable[[], object]:
    """SDPA on the same data: one batched call for the decodes, one call for a chunk."""
    decodes = [i for i, (_, q) in enumerate(seqs) if q == 1]
    chunks = [i for i, (_, q) in enumerate(seqs) if q > 1]
    kv = [_dense_kv(inputs, i, c + q) for i, (c, q) in enumerate(seqs)]
    starts = inputs["query_start_loc"].tolist()
    q_all = inputs["query"]
    dq = torch.stack([q_all[starts[i]] for i in decodes]).unsqueeze(2)  # [B, Hq, 1, D]
    dk = torch.cat([kv[i][0] for i in decodes])
    dv = torch.cat([kv[i][1] for i in decodes])
    chunk_args = []
    for i in chunks:
        c, q = seqs[i]
        qi = q_all[starts[i] : starts[i + 1]].transpose(0, 1).unsqueeze(0)
        pos_q = torch.arange(c, c + q, device=q_all.device)
        mask = torch.arange(c + q, device=q_all.device)[None, :] <= pos_q[:, None]
        chunk_args.append((qi, kv[i][0], kv[i][1], mask))

    def run() -> None:
        if decodes:
            F.scaled_dot_product_attention(dq, dk, dv, enable_gqa=True)
        for qi, ki, vi, mask in chunk_args:
            F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)

    return run


def _flashinfer_fn(
    inputs: dict[str, torch.Tensor], seqs: list[tuple[int, int]]
) -> Callable[[], object]:
    """FlashInfer's paged decode on the same cache (raises if unavailable)."""
    import flashinfer  # type: ignore[import-not-found]  # optional, GPU-only

    device = inputs["query"].device
    lens = [c + q for c, q in seqs]
    pages = [-(-n // BLOCK_SIZE) for n in lens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)  # fmt: skip
    indices = torch.cat([inputs["block_table"][i, :p] for i, p in enumerate(pages)])
    last = torch.tensor([(n - 1) % BLOCK_SIZE + 1 for n in lens], dtype=torch.int32,
                        device=device)  # fmt: skip
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, indices, last, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE,
                 data_type=inputs["query"].dtype)  # fmt: skip
    q, kc, vc = inputs["query"], inputs["key_cache"], inputs["value_cache"]
    return lambda: wrapper.run(q, (kc, vc))


def _args(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    names = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")
    return tuple(inputs[n] for n in names)


def bench_one(kind: str, context: int, dtype: torch.dtype, copy_gbs: float) -> BenchRow:
    """Time one configuration (see the module docstring)."""
    from refserve.kernels import oracle, paged_attention

    device = torch.device("cuda")
    inputs, seqs = _batch(kind, context, dtype, device)
    out = paged_attention(*_args(inputs))
    # Correctness first, on the first sequence only (the oracle is slow at 128k).
    first = {k: v for k, v in inputs.items()}
    q_len = seqs[0][1]
    first["query"] = inputs["query"][:q_len]
    first["block_table"] = inputs["block_table"][:1]
    first["seq_lens"] = inputs["seq_lens"][:1]
    first["query_start_loc"] = inputs["query_start_loc"][:2]
    ref = oracle.paged_attention(*_args(first))
    err = float((out[:q_len].float() - ref.float()).abs().max())

    args = _args(inputs)
    us = _time_us(lambda: paged_attention(*args, check_values=False))
    elt = torch.tensor([], dtype=dtype).element_size()
    kv_slots = sum(c + q for c, q in seqs)
    nbytes = 2 * kv_slots * NUM_KV_HEADS * HEAD_SIZE * elt + 2 * inputs["query"].numel() * elt
    gbs = nbytes / (us * 1e-6) / 1e9
    sdpa_us: float | None = None
    notes = []
    try:
        sdpa_us = _time_us(_sdpa_fn(inputs, seqs), reps=10)
    except Exception as exc:  # record, do not stop the benchmark
        notes.append(f"sdpa: {type(exc).__name__}: {exc}")
    fi_us: float | None = None
    if kind == "decode":
        try:
            fi_us = _time_us(_flashinfer_fn(inputs, seqs))
        except ImportError:
            notes.append("flashinfer not installed")
        except Exception as exc:  # an API mismatch must not stop the benchmark
            notes.append(f"flashinfer: {type(exc).__name__}: {exc}")
    return BenchRow(
        kind=kind, context=context, batch=len(seqs), dtype=str(dtype).removeprefix("torch."),
        time_us=round(us, 2), bytes_moved=nbytes, bandwidth_gbs=round(gbs, 1),
        fraction_of_copy=round(gbs / copy_gbs, 3),
        sdpa_time_us=None if sdpa_us is None else round(sdpa_us, 2),
        ratio_to_sdpa=None if sdpa_us is None else round(us / sdpa_us, 3),
        flashinfer_time_us=None if fi_us is None else round(fi_us, 2),
        ratio_to_flashinfer=None if fi_us is None else round(us / fi_us, 3),
        max_abs_err_first_seq=err, note="; ".join(notes) or None,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``python -m refserve.kernels.bench --json out/gpu_bench.json [--contexts 1024,4096]``."""
    parser = argparse.ArgumentParser(prog="python -m refserve.kernels.bench", description=__doc__)
    parser.add_argument("--json", dest="json_path", default="out/gpu_bench.json")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    given = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(given)
    if not torch.cuda.is_available():
        print("refserve.kernels.bench: needs a CUDA device (no GPU here)", file=sys.stderr)
        return 2
    import triton

    started = time.perf_counter()
    copy_gbs = copy_bandwidth_gbs(torch.device("cuda"))
    rows: list[dict[str, Any]] = []
    for kind in ("decode", "mixed"):
        for context in (int(c) for c in args.contexts.split(",")):
            for dtype in (torch.float16, torch.bfloat16):
                row = bench_one(kind, context, dtype, copy_gbs)
                print(json.dumps(asdict(row)), flush=True)
                rows.append(asdict(row))
                torch.cuda.empty_cache()
    report = {
        "format": FORMAT,
        "command": shlex.join(["python", "-m", "refserve.kernels.bench", *given]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shape": {"num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS,
                  "head_size": HEAD_SIZE, "block_size": BLOCK_SIZE, "chunk": CHUNK},
        "copy_bandwidth_gbs": round(copy_gbs, 1),
        "wall_s": round(time.perf_counter() - started, 1),
        "rows": rows,
    }  # fmt: skip
    with open(args.json_path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2, allow_nan=False)
        fh.write("\n")
    worst = max((r["max_abs_err_first_seq"] for r in rows), default=0.0)
    print(f"wrote {args.json_path}; copy {copy_gbs:.0f} GB/s; worst first-seq err {worst:.2e}")
    return 0 if math.isfinite(worst) and worst < 5e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
