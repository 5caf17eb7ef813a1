"""While a migration import is staged (ref/core/transit.py), the destination scheduler
refuses every other change: the staged blocks are in its open pool transaction, and a
change joining it would be undone by the import's abort (docs/MIGRATION.md)."""

from __future__ import annotations

import pytest

from refserve.core import transit
from refserve.core.config import SchedulerConfig
from refserve.core.request import StopParams
from refserve.core.scheduler import Scheduler, StepInProgress
from refserve.core.transit import MigrationError, MigrationRefused, RequestState
from refserve.errors import DuplicateRequest
from refserve.spec.snapshot import RequestStatus
from tests.harness import MemoryLink, Stepper, make_request
from tests.phased_migration import PhasedMigration, cluster_node

CFG = SchedulerConfig(num_blocks=16, block_size=4, max_num_batched_tokens=8)


def test_a_staged_import_blocks_every_change_until_it_ends() -> None:
    src = Stepper(CFG)
    src.add(make_request("r", 10))
    src.step()
    dst = Scheduler(CFG)
    dst.add_request(make_request("w", 3))
    imp = transit.begin_import(dst)
    imp.stage(transit.export(src.sched, "r").state, with_kv=True)
    busy = "a migration import is staged (commit or abort it)"
    for what, call in [
        ("schedule", dst.schedule),
        ("add_request", lambda: dst.add_request(make_request("x", 3))),
        ("abort", lambda: dst.abort("w")),
        ("import", lambda: transit.begin_import(dst)),
    ]:
        with pytest.raises(StepInProgress) as info:
            call()
        assert str(info.value) == f"{what}: {busy}"
    imp.abort()
    assert set(dst.requests) == {"w"} and dst.pool.num_free_blocks == CFG.num_blocks
    dst.schedule()  # free again
    with pytest.raises(StepInProgress, match=r"^import: a step is in progress"):
        transit.begin_import(dst)


def test_a_staged_id_already_live_here_is_refused_with_nothing_staged() -> None:
    src = Stepper(CFG)
    src.add(make_request("r", 10))
    src.step()
    dst = Scheduler(CFG)
    dst.add_request(make_request("r", 3))  # the same id, live on the destination
    before = dst.snapshot()
    imp = transit.begin_import(dst)
    state = transit.export(src.sched, "r").state
    with pytest.raises(DuplicateRequest) as info:
        imp.stage(state, with_kv=True)
    assert str(info.value) == "import: request id 'r' is already in use"
    with pytest.raises(DuplicateRequest, match=r"^import: request id 'r' is already in use$"):
        imp.stage(state, with_kv=False)
    imp.abort()
    assert dst.snapshot() == before


def _state(rid: str, kv: int, status: RequestStatus = RequestStatus.PREFILLING) -> RequestState:
    return RequestState(rid, (1, 2, 3, 4), (1, 2, 3, 4), StopParams(4), status, kv)


def test_running_slots_count_every_staged_arrival_holding_kv() -> None:
    """Two requests staged in one import (the samples of one request move together):
    the second needs a running slot too, even when the first holds one token of K/V."""
    dst = Scheduler(SchedulerConfig(num_blocks=8, block_size=2, max_num_seqs=1))
    imp = transit.begin_import(dst)
    imp.stage(_state("a", 1), with_kv=True)
    with pytest.raises(MigrationRefused) as info:
        imp.stage(_state("b", 1), with_kv=True)
    assert str(info.value) == "import: request 'b' needs a running slot; all 1 are taken"
    imp.stage(_state("c", 1), with_kv=False)  # no K/V: it waits, no slot needed
    imp.abort()


def test_a_state_that_is_not_live_is_refused_by_name() -> None:
    dst = Scheduler(CFG)
    imp = transit.begin_import(dst)
    with pytest.raises(MigrationError) as info:
        imp.stage(_state("r", 0, RequestStatus.FINISHED), with_kv=False)
    assert str(info.value) == "import: request 'r' is finished; only live requests move"
    imp.abort()


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [((1, 2), (1, 3, 4)), ((), (1, 2))],
    ids=["tokens that do not start with the prompt", "no prompt"],
)
def test_a_state_whose_tokens_do_not_start_with_its_prompt_is_refused(
    prompt: tuple[int, ...], tokens: tuple[int, ...]
) -> None:
    dst = Scheduler(CFG)
    before = dst.snapshot()
    imp = transit.begin_import(dst)
    state = RequestState("r", prompt, tokens, StopParams(4), RequestStatus.WAITING, 0)
    with pytest.raises(MigrationError, match="its token ids do not start with its prompt"):
        imp.stage(state, with_kv=False)
    imp.abort()
    assert dst.snapshot() == before


def test_the_move_records_and_guards_of_its_phases() -> None:
    cfg = SchedulerConfig(num_blocks=16, block_size=2, max_num_batched_tokens=16)
    src, dst = Stepper(cfg, memory=True), Stepper(cfg, memory=True)
    src.add(make_request("r", 6))
    src.step()
    move = PhasedMigration(src.sched, dst.sched, "r", with_kv=True, link=MemoryLink(src, dst))
    move.export()
    assert move.transit("s", "d").num_hit_tokens == 0  # nothing staged yet
    node = cluster_node("s", src.sched)
    assert node.memory is None and node.host_memory is None  # none given: none read
    a = move.stage()
    with pytest.raises(MigrationError, match=r"copy of \[0, 0\) out of order"):
        move.copy(a.num_hit_tokens, a.num_hit_tokens)  # an empty range is no copy
    for start, end in move.chunks():
        move.copy(start, end)
    move.ack()
    with pytest.raises(AssertionError):
        move.ack()  # once
    move.release()
    move.commit()
