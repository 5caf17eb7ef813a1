"""Flattened executor inputs built from a plan: token ids, positions, slots, block tables.

Layout follows kernels' unified (vLLM-style) API: the tokens of all scheduled requests
are concatenated; ``query_start_loc[i]`` is where request i's tokens begin, ``seq_lens``
its KV length including this step's tokens. Positions and slots are computed with array
ops from per-request starts and counts, not element by element. The invariant harness
reads the slot mapping from these arrays, so POS checks what the executor really gets.

The arrays are numpy, not torch: the core knows no tensor library (docs/ARCHITECTURE.md,
"Layers"; tests/repo/test_layers.py). The model executor wraps each as a torch tensor
with ``torch.from_numpy``, which shares the memory, so what POS reads is what the
forward reads (ref/model/executor.py).

A grouped pool (ref/kv/groups.py: a hybrid model's full and sliding-window layer groups)
keeps one table per request per group. The first group's table and slots are the fields
every step has (the scheduler's and the checks' view); each other group's are one
:class:`GroupInputs` in ``ModelInputs.groups``, built from the same positions. A window
group's table keeps :data:`~refserve.spec.groups.NULL_BLOCK` where a block left the
window: no token of the step is written there (:class:`NullBlockAccess` otherwise), and
the executor checks that no window layer reads one before it hands the backends a table.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from refserve.core.plan import StepPlan
from refserve.core.request import Request
from refserve.errors import RefserveError
from refserve.kv import BlockPool
from refserve.spec.arith import blocks_needed, logical_block_rows, slot_of_rows
from refserve.spec.groups import NULL_BLOCK, GroupedSnapshot, KVGroup
from refserve.spec.snapshot import ScheduledRequest

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]


class NullBlockAccess(RefserveError):
    """A step would write or read a place a window group let go (a ``NULL_BLOCK``
    entry): the pool released a block the step still needs, so the K/V there is gone
    (or another request's). Raised before anything is written."""


@dataclass(frozen=True)
class GroupInputs:
    """One layer group's own arrays (a grouped pool's group ``g >= 1``); every other
    array of the step (tokens, positions, query starts, KV lengths) is shared."""

    block_tables: I32  # [S, max_blocks]: NULL_BLOCK where a block left the window, 0 padding
    slot_mapping: I64  # [T]: where each token's K/V goes in this group's layers


@dataclass(frozen=True)
class ModelInputs:
    """One step's flattened inputs (module doc). Every array is the step's own: nothing
    else holds or changes it after it is built."""

    request_ids: tuple[str, ...]
    input_ids: I64  # [T]
    positions: I64  # [T]
    slot_mapping: I64  # [T]
    query_start_loc: I32  # [S + 1]
    seq_lens: I32  # [S]
    block_tables: I32  # [S, max_blocks], padded with 0 (never read)
    sample_rows: I64  # [num sampling requests]: token index of each logit
    sample_request_ids: tuple[str, ...]
    # Groups 1.. of a grouped pool (module doc); empty for the plain pool, whose one
    # table every layer reads.
    groups: tuple[GroupInputs, ...] = ()


class LayerGroupTables(Protocol):
    """A pool's layer groups (ref/kv/groups.py's ``GroupedPool``, which the composition
    plugs into the loop): the layout, each group's live tables, and the snapshot the
    step checks read (spec/groups.py)."""

    @property
    def groups(self) -> tuple[KVGroup, ...]: ...

    def group_table_views(self, group: int, request_ids: Sequence[str]) -> list[Sequence[int]]:
        """Live tables of ``request_ids`` in ``group`` (read-only)."""
        ...

    def grouped_snapshot(self) -> GroupedSnapshot: ...

    def has_request(self, request_id: str) -> bool: ...


class FastInputs(Protocol):
    """A faster way to build some steps' inputs (the bulk decode path's, ref/core/bulk.py)."""

    def inputs(self, plan: StepPlan) -> ModelInputs | None:
        """The inputs of ``plan``, or None when this way does not apply to it."""


def build_inputs(
    plan: StepPlan,
    requests: Mapping[str, Request],
    pool: BlockPool,
    fast: FastInputs | None = None,
    layer_groups: LayerGroupTables | None = None,
) -> ModelInputs:
    """The executor's inputs for ``plan``, from the requests and the pool's tables,
    unless ``fast`` builds them (a step of bulk decodes only, read from the batch's
    arrays). Both give equal arrays (tests/scheduler/test_fast_path.py). With
    ``layer_groups`` (the pool keeps several, module doc), every group's."""
    # A fast way builds one table's arrays: a grouped step takes the reference path.
    built = None if fast is None or layer_groups is not None else fast.inputs(plan)
    if built is not None:
        return built
    ids = plan.request_ids
    num_seqs = len(ids)
    starts = np.array(plan.starts, dtype=np.int64)
    counts = np.array(plan.num_new_tokens, dtype=np.int64)
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=qsl[1:])
    total = int(qsl[-1])
    all_decode = total == num_seqs  # the common steady state: one token each
    if all_decode:
        row = np.arange(num_seqs)
        positions = starts
        tokens = [requests[rid].token_ids[st] for rid, st in zip(ids, plan.starts, strict=True)]
    else:
        row = np.repeat(np.arange(num_seqs), counts)
        positions = np.arange(total, dtype=np.int64) - qsl[row] + starts[row]
        tokens = []
        drafts = plan.drafts
        for rid, st, n in zip(ids, plan.starts, plan.num_new_tokens, strict=True):
            tokens.extend(requests[rid].token_ids[st : st + n])
            if rid in drafts:  # a verification: its drafts follow its known tokens
                tokens.extend(drafts[rid])
    block_tables = _padded(pool.block_table_views(ids))
    bs = pool.block_size
    slots = slot_of_rows(block_tables[row, logical_block_rows(positions, bs)], positions, bs)
    sampling = [i for i, smp in enumerate(plan.samples) if smp]
    groups = () if layer_groups is None else _group_inputs(layer_groups, ids, row, positions, bs)
    return ModelInputs(
        request_ids=ids,
        input_ids=np.array(tokens, dtype=np.int64),
        positions=positions,
        slot_mapping=slots,
        query_start_loc=qsl.astype(np.int32),
        seq_lens=(starts + counts).astype(np.int32),
        block_tables=block_tables.astype(np.int32),
        sample_rows=qsl[1:][sampling] - 1,
        sample_request_ids=tuple(ids[i] for i in sampling),
        groups=groups,
    )


def _group_inputs(
    groups: LayerGroupTables,
    ids: Sequence[str],
    row: npt.NDArray[np.int_],
    positions: I64,
    bs: int,
) -> tuple[GroupInputs, ...]:
    """Each group's (but the first's) tables and slots, at the step's positions. A
    token written into a released place is refused: its slot would be a negative
    number, which the kernels read as "skip" (-1) or as an index from the end."""
    cols = logical_block_rows(positions, bs)
    out: list[GroupInputs] = []
    for g in range(1, len(groups.groups)):
        tables = _padded(groups.group_table_views(g, ids))
        blocks = tables[row, cols]
        if (blocks == NULL_BLOCK).any():
            t = int(np.argmax(blocks == NULL_BLOCK))
            raise NullBlockAccess(
                f"request {ids[int(row[t])]!r} writes position {int(positions[t])} into "
                f"logical block {int(cols[t])} of group {g}, a place the group released"
            )
        out.append(GroupInputs(tables.astype(np.int32), slot_of_rows(blocks, positions, bs)))
    return tuple(out)


def _padded(tables: Sequence[Sequence[int]]) -> I64:
    """Ragged tables -> ``[S, W]`` int64, zero-padded (padding is never read).

    Filling a typed ``array`` and wrapping it is an order of magnitude cheaper than a
    boolean-mask scatter or building from nested lists (measured with torch: 0.6 vs 8 us
    per request at 1024 requests of 8 blocks).
    """
    width = max((len(t) for t in tables), default=0)
    if width == 0:
        return np.zeros((len(tables), 0), dtype=np.int64)
    zeros = [0] * width
    flat = array("q")
    for t in tables:
        flat.extend(t)
        flat.extend(zeros[: width - len(t)])
    return np.frombuffer(flat, dtype=np.int64).reshape(len(tables), width)


def scheduled_requests(
    plan: StepPlan, inputs: ModelInputs, block_size: int
) -> tuple[ScheduledRequest, ...]:
    """The plan as spec sees it, read back from the executor's real inputs.

    Positions, slots and block tables come from the arrays the executor gets, not from
    the plan, so the POS/CAP/PREFIX checks verify what is actually executed.
    """
    qsl = inputs.query_start_loc.tolist()
    positions = inputs.positions.tolist()
    slots = inputs.slot_mapping.tolist()
    tables = inputs.block_tables.tolist()
    seq_lens = inputs.seq_lens.tolist()
    return tuple(
        ScheduledRequest(
            request_id=c.request_id,
            num_new_tokens=c.num_new_tokens,
            positions=tuple(positions[qsl[i] : qsl[i + 1]]),
            slot_mapping=tuple(slots[qsl[i] : qsl[i + 1]]),
            block_table=tuple(tables[i][: blocks_needed(seq_lens[i], block_size)]),
            samples=c.samples,
            num_new_cached_tokens=c.num_new_cached_tokens,
            num_draft_tokens=len(c.draft_token_ids),
        )
        for i, c in enumerate(plan.chunks)
    )
