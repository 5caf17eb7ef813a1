"""While a migration import is staged (ref/core/transit.py), the destination scheduler
refuses every other change: the staged blocks are in its open pool transaction, and a
change joining it would be undone by the import's abort (docs/MIGRATION.md)."""

from __future__ import annotations

import pytest

from ref.core import transit
from ref.core.config import SchedulerConfig
from ref.core.scheduler import Scheduler, StepInProgress
from ref.errors import DuplicateRequest
from tests.harness import Stepper, make_request

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
