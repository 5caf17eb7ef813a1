"""Flattened executor inputs built from a plan: token ids, positions, slots, block tables.

Layout follows kernels' unified (vLLM-style) API: the tokens of all scheduled requests
are concatenated; ``query_start_loc[i]`` is where request i's tokens begin, ``seq_lens``
its KV length including this step's tokens. Positions and slots are computed with tensor
ops from per-request starts and counts, not element by element. The invariant harness
reads the slot mapping from these tensors, so POS checks what the executor really gets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ref.kv import BlockPool
from ref.plan import StepPlan
from ref.request import Request


@dataclass(frozen=True)
class ModelInputs:
    request_ids: tuple[str, ...]
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with 0 (never read)
    sample_rows: torch.Tensor  # int64 [num sampling requests]: token index of each logit
    sample_request_ids: tuple[str, ...]


def build_inputs(plan: StepPlan, requests: Mapping[str, Request], pool: BlockPool) -> ModelInputs:
    chunks = plan.chunks
    ids = tuple(c.request_id for c in chunks)
    starts = torch.tensor([c.start for c in chunks], dtype=torch.int64)
    counts = torch.tensor([c.num_new_tokens for c in chunks], dtype=torch.int64)
    qsl = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=qsl[1:])
    total = int(qsl[-1])
    row = torch.repeat_interleave(torch.arange(len(chunks)), counts)
    positions = torch.arange(total, dtype=torch.int64) - qsl[row] + starts[row]
    tables: list[Sequence[int]] = [pool.block_table_view(rid) for rid in ids]
    width = max((len(t) for t in tables), default=0)
    flat: list[int] = []
    for t in tables:
        flat.extend(t)
        flat.extend([0] * (width - len(t)))
    block_tables = torch.tensor(flat, dtype=torch.int64).view(len(chunks), width)
    bs = pool.block_size
    slots = block_tables[row, positions // bs] * bs + positions % bs
    tokens: list[int] = []
    for c in chunks:
        tokens.extend(requests[c.request_id].token_ids[c.start : c.start + c.num_new_tokens])
    sampling = [i for i, c in enumerate(chunks) if c.samples]
    return ModelInputs(
        request_ids=ids,
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=positions,
        slot_mapping=slots,
        query_start_loc=qsl.to(torch.int32),
        seq_lens=(starts + counts).to(torch.int32),
        block_tables=block_tables.to(torch.int32),
        sample_rows=qsl[1:][sampling] - 1,
        sample_request_ids=tuple(ids[i] for i in sampling),
    )
