"""The persistent batch (ref/core/batch.py): slots, rows and the array form of a step.

The differential test (test_fast_path.py) checks that the bulk path plans, builds inputs
and commits exactly as the reference loop does; these tests pin the batch's own rules:
slots are recycled, the running order is kept through removals, the arrays grow, a
row follows its request, the block table follows the pool (after a rollback too), and
the executor's sampled tokens as an array are checked like the mapping form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from refserve.core.bulk import BulkBatch
from refserve.core.config import SchedulerConfig
from refserve.core.executor_output import BadExecutorOutput
from refserve.core.inputs import build_inputs
from refserve.core.outcome import Outcome
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.kv import BlockPool, DecodeGrowth, DecodeRun
from refserve.spec.snapshot import RequestStatus
from tests.harness import make_request

S = RequestStatus


def decoding(n: int, *, block_size: int = 4, num_blocks: int = 256, **stop: object) -> Scheduler:
    """``n`` requests of 3 prompt tokens, each decoding with one sampled token (5)."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=256, max_num_seqs=64, block_size=block_size, num_blocks=num_blocks
    )
    s = Scheduler(cfg)
    for i in range(n):
        params = StopParams(**{"max_tokens": 50, "ignore_eos": True, **stop})  # type: ignore[arg-type]
        s.add_request(Request(f"r{i}", [i + 1, i + 2, i + 3], params))
    plan = s.schedule()
    s.commit(plan, torch.full((sum(plan.samples),), 5))
    assert all(r.status is S.DECODING for r in s.running)
    return s


def test_rows_mirror_the_running_requests() -> None:
    s = decoding(3)
    b = s.batch
    for r in s.running:
        slot = b._slot[r.request_id]
        assert b.num_computed[slot] == r.num_computed_tokens == 3
        assert b.last_token[slot] == r.token_ids[-1] == 5
        assert b.kv_limit[slot] == r.num_prompt_tokens + 50 - 1  # then it holds the limit
        assert b.decoding[slot]
        table = s.pool.block_table(r.request_id)
        assert b.num_blocks[slot] == len(table)
        assert tuple(b.block_table[slot, : len(table)]) == table
        assert not b.block_table[slot, len(table) :].any()  # padding is zero


@pytest.mark.mutation_kill
def test_the_arrays_keep_their_types_as_they_grow_and_widen() -> None:
    """Token ids, KV lengths and block ids are int64 and the flags bool on every
    platform (numpy's default int is 32-bit on some), through growth in slots (17
    rows), in table width (10 blocks of one token) and in stop-id columns (three)."""
    s = decoding(17, block_size=1, stop_token_ids=(1, 2, 3))
    for _ in range(6):
        plan = s.schedule()
        s.commit(plan, torch.full((sum(plan.samples),), 7))
    b = s.batch
    assert len(b.num_computed) > 16 and b.stop_ids.shape[1] == 3 and b.block_table.shape[1] > 8
    for name in ("num_computed", "last_token", "kv_limit", "stop_ids", "num_blocks", "block_table"):
        assert getattr(b, name).dtype == np.int64, name
    assert b.decoding.dtype == np.bool_ and b.shared_tail.dtype == np.bool_


def test_slots_are_recycled_and_the_order_is_kept() -> None:
    s = decoding(4)
    b = s.batch
    freed = b._slot["r1"]
    s.abort("r1")
    assert [r.request_id for r in s.running] == ["r0", "r2", "r3"]
    assert "r1" not in b and len(b) == 3
    s.add_request(Request("new", [9, 9], StopParams(max_tokens=5, ignore_eos=True)))
    plan = s.schedule()
    s.commit(plan, torch.full((sum(plan.samples),), 7))
    assert b._slot["new"] == freed  # the slot r1 left
    assert [r.request_id for r in s.running] == ["r0", "r2", "r3", "new"]
    assert list(b.order) == [b._slot[rid] for rid in ("r0", "r2", "r3", "new")]


def test_the_arrays_grow_past_their_first_capacity_and_width() -> None:
    s = decoding(40, block_size=1, num_blocks=1024)  # 40 slots > 16; 3 blocks, then more
    b = s.batch
    assert len(b.num_computed) >= 40
    for _ in range(12):  # every request gains a block each step (block size 1)
        plan = s.schedule()
        inputs = build_inputs(plan, s.requests, s.pool, b)
        assert plan.decode_rows is not None
        s.commit(plan, torch.full((len(inputs.sample_request_ids),), 6))
    assert b.block_table.shape[1] >= 16
    for r in s.running:
        slot = b._slot[r.request_id]
        table = s.pool.block_table(r.request_id)
        assert tuple(b.block_table[slot, : len(table)]) == table


def test_stop_ids_and_eos_finish_a_bulk_decode_with_reason_stop() -> None:
    s = decoding(3, stop_token_ids=(40, 41, 42), eos_token_id=43, ignore_eos=False)
    plan = s.schedule()
    assert plan.decode_rows is not None and s.batch.stop_ids.shape[1] >= 4
    events = s.commit(plan, torch.tensor([41, 43, 8]))
    assert events.finished == ("r0", "r1")
    assert [r.finish_reason for r in s.retired] == [FinishReason.STOP, FinishReason.STOP]
    assert [r.request_id for r in s.running] == ["r2"]


def test_ignore_eos_is_not_a_stop_in_the_batch() -> None:
    s = decoding(1, eos_token_id=43, ignore_eos=True)
    plan = s.schedule()
    assert s.commit(plan, torch.tensor([43])).finished == ()


def test_the_length_limit_finishes_a_bulk_decode_with_reason_length() -> None:
    s = decoding(2, max_tokens=2)
    plan = s.schedule()
    assert plan.decode_rows is not None
    events = s.commit(plan, torch.tensor([8, 9]))
    assert events.finished == ("r0", "r1")
    assert {r.finish_reason for r in s.retired} == {FinishReason.LENGTH}
    assert not s.running and not s.batch.order.size


def test_the_table_rows_follow_a_rollback() -> None:
    s = decoding(2, block_size=3)  # 3 tokens stored: the next one starts a block
    before = {r.request_id: s.pool.block_table(r.request_id) for r in s.running}
    s.schedule()
    b = s.batch
    assert all(b.num_blocks[b._slot[rid]] == len(t) + 1 for rid, t in before.items())
    s.rollback()
    plan = s.schedule()  # planned again from the rolled-back tables
    inputs = build_inputs(plan, s.requests, s.pool, b)
    assert np.array_equal(inputs.block_tables, build_inputs(plan, s.requests, s.pool).block_tables)


def test_bulk_decodes_come_back_as_columns_in_plan_order() -> None:
    s = decoding(3)
    plan = s.schedule()
    outcome = s.commit(plan, np.array([7, 8, 9]))
    # The steady step: the bulk decodes as two columns, no per-request record.
    assert list(outcome.decoded_ids) == ["r0", "r1", "r2"] and outcome.outcomes == ()
    assert outcome.decoded_tokens.tolist() == [7, 8, 9]
    assert list(outcome.last_tokens()) == [("r0", 7), ("r1", 8), ("r2", 9)]
    assert dict(outcome.last_tokens()) == {"r0": 7, "r1": 8, "r2": 9}


def test_a_bulk_decode_that_finishes_is_one_outcome_not_a_column() -> None:
    s = decoding(3)
    s.requests["r1"].stop = StopParams(max_tokens=1 << 20, stop_token_ids=(8,))
    s.batch.reload(s.requests["r1"], s.pool)
    held = len(s.pool.block_table("r1"))
    plan = s.schedule()
    outcome = s.commit(plan, np.array([7, 8, 9]))
    assert list(outcome.decoded_ids) == ["r0", "r2"] and outcome.decoded_tokens.tolist() == [7, 9]
    assert outcome.outcomes == (Outcome("r1", (8,), FinishReason.STOP, held),)
    assert outcome.finished == ("r1",) and dict(outcome.last_tokens()) == {
        "r0": 7,
        "r2": 9,
        "r1": 8,
    }


@pytest.mark.parametrize(
    ("sampled", "what"),
    [
        (torch.tensor([1, 2]), "of 3"),  # too short
        (torch.tensor([1, 2, 3, 4]), "of 3"),  # too long
        (torch.tensor([[1, 2, 3]]), "of 3"),  # 2-D
        (torch.tensor([1.0, 2.0, 3.0]), "float"),
        (torch.tensor([True, False, True]), "bool"),
        (np.array([1, -2, 3]), "-2"),
        (np.array([1, 2, 2**64 - 1], dtype=np.uint64), "request 'r2'"),
        ({"r0": 1, "r1": 2}, "None"),  # one request missing
        ({"r0": 1, "r1": True, "r2": 3}, "True"),
        ({"r0": 1, "r1": 2**70, "r2": 3}, "1180591620717411303424"),
    ],
)
def test_bad_sampled_tokens_are_refused_and_the_step_can_roll_back(
    sampled: object, what: str
) -> None:
    s = decoding(3)
    before = s.snapshot()
    plan = s.schedule()
    with pytest.raises(BadExecutorOutput, match=what.replace("[", r"\[")):
        s.commit(plan, sampled)  # type: ignore[arg-type]
    s.rollback()
    assert s.snapshot() == before
    plan = s.schedule()
    s.commit(plan, torch.tensor([1, 2, 3]))
    assert [r.output_token_ids for r in s.running] == [[5, 1], [5, 2], [5, 3]]


def test_an_array_covers_the_sampling_entries_after_the_bulk_decodes_too() -> None:
    s = decoding(2)
    s.add_request(make_request("p", 6, max_tokens=5))
    plan = s.schedule()  # r0, r1 decode in bulk; p prefills and samples
    assert plan.decode_rows is not None and plan.request_ids == ("r0", "r1", "p")
    events = s.commit(plan, torch.tensor([11, 12, 13]))
    assert dict(events.last_tokens()) == {"r0": 11, "r1": 12, "p": 13}
    p = s.requests["p"]
    assert p.output_token_ids == [13] and p.status is S.DECODING
    assert s.batch.decoding[s.batch._slot["p"]]  # its row was reloaded after commit


class _DeviceArray:
    """Stands for a tensor on an accelerator: numpy cannot read it through ``__array__``
    (torch raises TypeError there), ``tolist`` can; without ``tolist`` nothing can."""

    def __init__(self, values: list[int], *, listable: bool = True) -> None:
        self.values = values
        if listable:
            self.tolist = lambda: list(values)

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        raise TypeError("can't convert cuda:0 device type tensor to numpy")


def test_an_array_numpy_cannot_read_is_read_through_tolist() -> None:
    # The core imports no torch, so a device tensor's own numpy(force=True) is not used.
    s = decoding(3)
    plan = s.schedule()
    assert dict(s.commit(plan, _DeviceArray([4, 5, 6])).last_tokens()) == {
        "r0": 4,
        "r1": 5,
        "r2": 6,
    }
    plan = s.schedule()
    with pytest.raises(BadExecutorOutput, match="gave a _DeviceArray as the sampled tokens"):
        s.commit(plan, _DeviceArray([4, 5, 6], listable=False))  # type: ignore[arg-type]


@pytest.mark.mutation_kill
def test_an_empty_array_numpy_cannot_read_is_refused_as_an_empty_int_array() -> None:
    """An empty list from ``tolist`` reads as an empty int array: a step that samples
    three tokens refuses it by its length, as any short array (no other error)."""
    s = decoding(3)
    plan = s.schedule()
    with pytest.raises(BadExecutorOutput, match=r"gave a int64 array of shape \(0,\) "):
        s.commit(plan, _DeviceArray([]))


@pytest.mark.mutation_kill
def test_after_an_abort_the_next_step_still_takes_the_bulk_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Removing a request rebuilds the running order the bulk path reads; a stale order
    would silently send every later step down the reference loop."""
    s = decoding(4)
    s.abort("r2")
    calls: list[list[str]] = []
    bulk = DecodeRun.append_decodes

    def spy(run: DecodeRun, *args: list[int]) -> object:
        calls.append(list(run.request_ids))
        return bulk(run, *args)

    monkeypatch.setattr(DecodeRun, "append_decodes", spy)
    plan = s.schedule()
    assert calls == [["r0", "r1", "r3"]] and plan.decode_rows is not None
    s.commit(plan, torch.tensor([1, 2, 3]))


@pytest.mark.mutation_kill
def test_the_slots_of_finished_requests_are_reused() -> None:
    s = decoding(3, max_tokens=2)
    b = s.batch
    slots = {rid: b._slot[rid] for rid in ("r0", "r1", "r2")}
    plan = s.schedule()
    assert s.commit(plan, torch.tensor([7, 7, 7])).finished == ("r0", "r1", "r2")
    assert sorted(b._free[-3:]) == sorted(slots.values()) and None not in b._free
    for i in range(3):
        s.add_request(Request(f"n{i}", [5, 6], StopParams(max_tokens=4, ignore_eos=True)))
    plan = s.schedule()
    s.commit(plan, torch.full((sum(plan.samples),), 3))
    assert {b._slot[f"n{i}"] for i in range(3)} == set(slots.values())


@pytest.mark.parametrize(
    ("sampled", "given"),
    [
        ([1, 2, 3], "a list"),
        (torch.tensor([[1, 2, 3]]), "a int64 array of shape (1, 3)"),
        (np.array([1.5, 2.0, 3.0]), "a float64 array of shape (3,)"),
    ],
)
def test_a_sampled_array_of_the_wrong_kind_is_named_in_the_error(
    sampled: object, given: str
) -> None:
    s = decoding(3)
    plan = s.schedule()
    with pytest.raises(BadExecutorOutput) as e:
        s.commit(plan, sampled)  # type: ignore[arg-type]
    assert str(e.value) == (
        f"step 1: executor gave {given} as the sampled tokens; expected a 1-D int array "
        "of 3, one per sampling request in plan order, or a mapping by request id"
    )


@pytest.mark.mutation_kill
def test_token_id_zero_is_a_valid_sampled_token_in_an_array() -> None:
    s = decoding(3)
    plan = s.schedule()
    assert dict(s.commit(plan, np.array([0, 1, 0])).last_tokens()) == {"r0": 0, "r1": 1, "r2": 0}
    assert [r.token_ids[-1] for r in s.running] == [0, 1, 0]


@pytest.mark.mutation_kill
def test_steady_steps_look_up_the_pool_tables_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """While nobody joins or leaves and no table changes outside the bulk path, the
    batch keeps its DecodeRun: the steady step looks no request up in the pool."""
    s = decoding(3)
    lookups: list[list[str]] = []
    look_up = DecodeRun.__init__

    def spy(run: DecodeRun, pool: BlockPool, ids: list[str]) -> None:
        lookups.append(list(ids))
        look_up(run, pool, ids)

    monkeypatch.setattr(DecodeRun, "__init__", spy)
    for _ in range(6):  # block 4: two of these steps start a block, all stay in bulk
        plan = s.schedule()
        assert plan.decode_rows is not None
        s.commit(plan, torch.tensor([7, 7, 7]))
    assert lookups == [["r0", "r1", "r2"]]
    s.abort("r1")  # membership changed: one new lookup
    for _ in range(2):
        s.commit(s.schedule(), torch.tensor([7, 7]))
    assert lookups == [["r0", "r1", "r2"], ["r0", "r2"]]


@pytest.mark.mutation_kill
def test_a_committed_plan_still_describes_its_rows_as_planned() -> None:
    """The rows' positions are a copy taken at planning: the commit that advances the KV
    lengths (and any later step) leaves a kept plan's rows as they were."""
    s = decoding(3)
    plan = s.schedule()
    rows = plan.decode_rows
    assert rows is not None and isinstance(rows.at, slice)  # slots 0, 1, 2: a slice
    assert rows.positions.tolist() == list(plan.starts) == [3, 3, 3]
    s.commit(plan, torch.tensor([7, 7, 7]))
    s.commit(s.schedule(), torch.tensor([7, 7, 7]))
    assert rows.positions.tolist() == list(plan.starts) == [3, 3, 3]
    assert rows.offsets.tolist() == [3, 3, 3]


@pytest.mark.mutation_kill
def test_a_lone_decoding_request_takes_the_bulk_path() -> None:
    s = decoding(1)
    plan = s.schedule()
    assert plan.decode_rows is not None and plan.request_ids == ("r0",)
    s.commit(plan, torch.tensor([7]))


@pytest.mark.mutation_kill
def test_decodes_before_a_running_prefill_still_go_in_bulk() -> None:
    """A running request still prefilling (a long prompt in chunks) is not a decode row;
    the decoding rows around it are picked out and still go in bulk."""
    s = decoding(2)
    s.add_request(make_request("p", 800, max_tokens=5))  # three chunks of the 256 budget
    s.commit(s.schedule(), torch.tensor([7, 7]))  # p's first chunk samples nothing
    assert [r.request_id for r in s.running] == ["r0", "r1", "p"]
    plan = s.schedule()
    rows = plan.decode_rows
    assert rows is not None and rows.request_ids == ["r0", "r1"]
    assert plan.request_ids == ("r0", "r1", "p") and plan.is_prefill == (False, False, True)
    assert plan.samples == (True, True, False)
    s.commit(plan, torch.tensor([7, 7]))


@pytest.mark.mutation_kill
def test_a_negative_token_is_named_by_its_own_request_after_a_zero() -> None:
    """The error names the request whose token is negative, not an earlier one whose
    token is 0 (a valid id); nothing is committed."""
    s = decoding(3)
    plan = s.schedule()
    with pytest.raises(BadExecutorOutput, match=r"gave -4 as the sampled token of request 'r1'"):
        s.commit(plan, np.array([0, -4, 1]))
    s.rollback()
    assert [r.token_ids[-1] for r in s.running] == [5, 5, 5]


def _count_ref_count_calls(s: Scheduler) -> list[int]:
    """Record each block whose reference count the scheduler asks the pool for."""
    asked: list[int] = []
    ref_count = s.pool.ref_count

    def spy(block: int) -> int:
        asked.append(block)
        return ref_count(block)

    s.pool.ref_count = spy  # type: ignore[method-assign]
    return asked


@pytest.mark.mutation_kill
def test_the_steady_step_asks_about_a_rows_last_block_only_when_it_loads_it() -> None:
    """A row's last block is checked for sharing when its table is loaded, and then
    only if it may be shared (a fork's): a row loaded with a private block, or given a
    fresh one by the bulk step, is not checked again; the steady step enters Python
    per row only for rows that need a block."""
    s = decoding(3)
    loaded = [s.pool.block_table_view(r.request_id)[-1] for r in s.running]
    asked = _count_ref_count_calls(s)
    for _ in range(6):  # block 4: every row starts a new block on the second step
        plan = s.schedule()
        assert plan.decode_rows is not None
        s.commit(plan, torch.tensor([7, 7, 7]))
    assert sorted(asked) == sorted(loaded)  # once each: the first step reloads the tables


@pytest.mark.mutation_kill
def test_a_forked_rows_last_block_is_checked_until_it_is_copied_away() -> None:
    """A fork shares its parent's last block: both rows are checked each step until the
    write that copies it, then never again."""
    s = decoding(1)  # r0: KV for 3 tokens, its 4th (5) at position 3 of block 0
    s.fork("r0", "c0", 6, StopParams(max_tokens=50, ignore_eos=True))
    asked = _count_ref_count_calls(s)
    plan = s.schedule()  # both write position 3 of the shared block: one copies it
    s.commit(plan, torch.tensor([7, 7]))
    assert asked and len(plan.request_ids) == 2
    asked.clear()
    for _ in range(5):
        plan = s.schedule()
        assert plan.decode_rows is not None and len(plan.decode_rows.slots) == 2
        s.commit(plan, torch.tensor([7, 7]))
    assert asked == []


def _fork_whose_sibling_copied_away() -> Scheduler:
    """With a budget of two decodes, a fork ``c0`` waits behind ``r0`` and ``r1``; ``r0``
    copies the shared block away and ``r1`` finishes: ``c0``'s row is still flagged as
    sharing its last block, which is private now, and ``c0`` decodes in the next step."""
    cfg = SchedulerConfig(max_num_batched_tokens=2, max_num_seqs=8, block_size=4, num_blocks=64)
    s = Scheduler(cfg)
    s.add_request(Request("r0", [1], StopParams(max_tokens=50, ignore_eos=True)))
    s.add_request(Request("r1", [2], StopParams(max_tokens=2, ignore_eos=True)))
    s.commit(s.schedule(), torch.tensor([5, 5]))
    s.fork("r0", "c0", 6, StopParams(max_tokens=50, ignore_eos=True))
    step = s.schedule()  # r0 writes the shared block: a private copy
    assert step.request_ids == ("r0", "r1") and len(step.copies) == 1
    s.commit(step, torch.tensor([7, 7]))  # r1 finishes
    return s


@pytest.mark.mutation_kill
def test_a_row_whose_sibling_copied_away_is_checked_once_more() -> None:
    """With a budget of two decodes, a fork ``c0`` waits behind ``r0`` and ``r1``; ``r0``
    copies the shared block away, and when ``r1`` has finished, ``c0``'s next step finds
    the block private, clears its flag, and is not checked again."""
    s = _fork_whose_sibling_copied_away()
    asked = _count_ref_count_calls(s)
    step = s.schedule()
    assert step.request_ids == ("r0", "c0") and step.copies == ()
    s.commit(step, torch.tensor([7, 7]))
    assert len(asked) == 1  # c0's flagged block, found private
    for _ in range(4):
        s.commit(s.schedule(), torch.tensor([7, 7]))
    assert len(asked) == 1


def _config(block_size: int = 4) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=256, max_num_seqs=64, block_size=block_size, num_blocks=256
    )


@pytest.mark.mutation_kill
def test_the_running_list_is_copied_before_a_change_only_while_a_step_holds_it() -> None:
    """Changes are in place, but the first after a steady step lent the list copies it."""
    s = Scheduler(_config())
    running = s.running
    for i in range(3):
        s.add_request(make_request(f"r{i}", 3, max_tokens=50, base=10 * i))
    s.commit(s.schedule(), torch.tensor([5, 5, 5]))  # admitted: appended in place
    assert s.running is running and len(running) == 3
    plan = s.schedule()  # the steady step: its rows are the running list itself
    assert plan.decode_rows is not None and plan.decode_rows.requests is running
    s.commit(plan, torch.tensor([7, 7, 7]))
    s.abort("r1")
    assert s.running is not running
    assert [r.request_id for r in plan.decode_rows.requests] == ["r0", "r1", "r2"]
    copied = s.running
    assert [r.request_id for r in copied] == ["r0", "r2"]
    s.abort("r2")  # nothing holds the copy: in place
    assert s.running is copied and [r.request_id for r in copied] == ["r0"]


@pytest.mark.mutation_kill
def test_a_commit_that_finishes_rows_leaves_the_new_running_list_unlent() -> None:
    """Finishes leave through new lists, so the next leave changes the list in place."""
    s = Scheduler(_config())
    for i, max_tokens in enumerate((50, 2, 50)):
        s.add_request(make_request(f"r{i}", 3, max_tokens=max_tokens, base=10 * i))
    s.commit(s.schedule(), torch.tensor([5, 5, 5]))
    plan = s.schedule()
    rows = plan.decode_rows
    assert rows is not None and rows.requests is s.running
    assert s.commit(plan, torch.tensor([7, 7, 7])).finished == ("r1",)
    assert [r.request_id for r in rows.requests] == ["r0", "r1", "r2"]
    running = s.running
    assert [r.request_id for r in running] == ["r0", "r2"]
    s.abort("r0")
    assert s.running is running and [r.request_id for r in running] == ["r2"]


@pytest.mark.mutation_kill
def test_a_new_batch_has_an_empty_order_no_width_and_no_decode_rows() -> None:
    """Empty int64 order, width 0, all (none) decoding, and no decode rows for any limit."""
    b = BulkBatch(block_size=4, max_len=64)
    assert b.order.dtype == np.int64 and b.order.shape == (0,)
    assert b.width() == 0
    assert b.all_decoding() is True
    assert b.decode_rows(0) is None and b.decode_rows(5) is None


@pytest.mark.mutation_kill
def test_a_batch_whose_requests_all_left_has_no_width_and_no_decode_rows() -> None:
    """Once every running request has finished, the batch reads as a new one."""
    s = decoding(2, max_tokens=2)
    b = s.batch
    assert b.width() > 0
    assert s.commit(s.schedule(), torch.tensor([7, 7])).finished == ("r0", "r1")
    assert b.order.dtype == np.int64 and b.order.shape == (0,)
    assert b.width() == 0 and b.all_decoding() is True
    assert b.decode_rows(0) is None and b.decode_rows(5) is None


@pytest.mark.mutation_kill
def test_a_limit_of_zero_gives_no_decode_rows() -> None:
    """``decode_rows(0)`` of a decoding batch is None; a limit of 1 takes the first row."""
    s = decoding(2)
    assert s.batch.decode_rows(0) is None
    rows = s.batch.decode_rows(1)
    assert rows is not None and rows.request_ids == ["r0"]


@pytest.mark.mutation_kill
def test_a_request_the_pool_holds_no_table_for_loads_an_empty_row() -> None:
    """No table in the pool: an all-zero row (recycled slot too), no blocks, no shared tail."""
    pool = BlockPool(64, 4)
    b = BulkBatch(block_size=4, max_len=64)
    a = make_request("a", 6, 5)
    pool.allocate("a", a.token_ids, 6)
    b.append(a, pool)
    slot = b._slot["a"]
    assert b.num_blocks[slot] == 2 and b.block_table[slot].any()
    b.remove(a)
    x = make_request("x", 3, 5, base=20)
    assert not pool.has_request("x")
    b.append(x, pool)
    assert b._slot["x"] == slot  # the row a left
    assert not b.block_table[slot].any() and b.num_blocks[slot] == 0
    assert not b.shared_tail[slot] and b.width() == 0


@pytest.mark.mutation_kill
def test_a_loaded_table_widens_the_block_table_by_doubling_only_past_its_width() -> None:
    """Width 8 holds a table of 8 blocks as it is; one of 9 doubles it to 16, rows kept."""
    pool = BlockPool(64, 1)
    b = BulkBatch(block_size=1, max_len=64)
    a = make_request("a", 8, 5)
    pool.allocate("a", a.token_ids, 8)
    b.append(a, pool)
    assert b.block_table.shape == (16, 8)
    c = make_request("c", 9, 5, base=20)
    pool.allocate("c", c.token_ids, 9)
    b.append(c, pool)
    assert b.block_table.shape == (16, 16)
    for rid in ("a", "c"):
        table = pool.block_table(rid)
        assert tuple(b.block_table[b._slot[rid], : len(table)]) == table


@pytest.mark.mutation_kill
def test_the_seventeenth_request_doubles_the_capacity() -> None:
    """Slots start at 16 and double when all are taken, not before."""
    assert len(decoding(16).batch.num_computed) == 16
    b = decoding(17).batch
    for name in ("num_computed", "last_token", "kv_limit", "decoding", "num_blocks"):
        assert len(getattr(b, name)) == 32, name
    assert b.stop_ids.shape[0] == 32 and b.block_table.shape[0] == 32


@pytest.mark.mutation_kill
def test_the_bulk_step_widens_the_block_table_by_doubling_only_past_its_width() -> None:
    """A bulk step growing a table to width 8 keeps it; growing to 9 doubles it to 16."""
    s = Scheduler(_config(block_size=1))
    s.add_request(make_request("r0", 7, max_tokens=50))
    s.commit(s.schedule(), torch.tensor([5]))  # 7 blocks
    b = s.batch
    assert b.block_table.shape[1] == 8
    for blocks, width in ((8, 8), (9, 16)):
        plan = s.schedule()
        assert plan.decode_rows is not None
        s.commit(plan, torch.tensor([7]))
        table = s.pool.block_table("r0")
        assert len(table) == blocks and b.block_table.shape[1] == width
        assert tuple(b.block_table[b._slot["r0"], :blocks]) == table


@pytest.mark.mutation_kill
def test_a_row_whose_sibling_copied_away_is_not_claimed_to_need_a_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forked row whose last block is private again, with room, claims no new block."""
    s = _fork_whose_sibling_copied_away()
    claims: list[list[int]] = []
    append_decodes = DecodeRun.append_decodes

    def spy(
        run: DecodeRun, tokens: Sequence[int], needy: Sequence[int], *rest: Any
    ) -> DecodeGrowth | None:
        claims.append(list(needy))
        return append_decodes(run, tokens, needy, *rest)

    monkeypatch.setattr(DecodeRun, "append_decodes", spy)
    step = s.schedule()  # r0 writes position 2 and c0 position 1 of private blocks
    assert step.decode_rows is not None and step.request_ids == ("r0", "c0")
    assert claims == [[]] and step.copies == ()
    s.commit(step, torch.tensor([7, 7]))


@pytest.mark.mutation_kill
def test_the_first_decoding_rows_before_a_running_prefill_are_read_as_a_slice() -> None:
    """The first ``limit`` rows all decode (a prefill after): ``at`` is a slice, no gather."""
    s = decoding(2)
    s.add_request(make_request("p", 800, max_tokens=5))  # prefills over several steps
    s.commit(s.schedule(), torch.tensor([7, 7]))
    assert [r.request_id for r in s.running] == ["r0", "r1", "p"]
    assert not s.batch.all_decoding()
    rows = s.batch.decode_rows(2)
    assert rows is not None and rows.request_ids == ["r0", "r1"]
    assert isinstance(rows.at, slice) and rows.at == slice(0, 2)


@pytest.mark.mutation_kill
def test_the_stop_id_matrix_widens_only_to_the_largest_stop_id_set() -> None:
    """One column while each request has at most one stop id; three ids widen it to three."""
    s = decoding(3, eos_token_id=43, ignore_eos=False)
    b = s.batch
    assert b.stop_ids.shape == (16, 1)
    assert [b.stop_ids[b._slot[r.request_id], 0] for r in s.running] == [43, 43, 43]
    s.add_request(Request("w", [9, 9], StopParams(max_tokens=5, stop_token_ids=(40, 41, 42))))
    s.commit(s.schedule(), torch.tensor([7, 7, 7, 7]))
    assert b.stop_ids.shape == (16, 3)
    assert b.stop_ids[b._slot["w"]].tolist() == [40, 41, 42]


@pytest.mark.mutation_kill
def test_a_bulk_decode_stops_on_either_of_two_stop_ids() -> None:
    """With two stop ids per request, a token equal to either one finishes it (STOP)."""
    s = decoding(3, stop_token_ids=(40, 41))
    assert s.batch.stop_ids.shape[1] == 2
    plan = s.schedule()
    assert plan.decode_rows is not None
    assert s.commit(plan, torch.tensor([41, 40, 8])).finished == ("r0", "r1")
    assert [r.finish_reason for r in s.retired] == [FinishReason.STOP, FinishReason.STOP]
