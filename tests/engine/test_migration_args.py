"""The one check of a migration driver's arguments (``MigrationArgs.check``,
docs/MIGRATION.md "The protocol"), on the engine's driver and on the scheduler-level
phased migration of the tests; the cluster's two paths are tests/cluster/test_cluster.py's.
And the one meaning of "the source changed" (``source_changed``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refserve.core.config import SchedulerConfig
from refserve.core.request import Request, StopParams
from refserve.core.transit import InvalidMigrationArgument, MigrationArgs, export, source_changed
from refserve.engine.llm_engine import LLMEngine
from refserve.engine.migration import migrate
from refserve.errors import InvalidArgument
from refserve.model.sampler import SamplingParams
from tests.engine.migration_helpers import make_engine, one_torch_thread
from tests.harness import MemoryLink, Stepper
from tests.phased_migration import PhasedMigration


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


BAD = [
    ({"chunk_blocks": 0, "kv": "recompute"}, "chunk_blocks", "chunk_blocks must be an int >= 1"),
    ({"chunk_blocks": 0}, "chunk_blocks", "chunk_blocks must be an int >= 1"),
    ({"chunk_blocks": True}, "chunk_blocks", "chunk_blocks must be an int >= 1"),
    ({"kv": "teleport"}, "kv", "kv must be one of transfer, recompute, auto, got .teleport."),
    ({"cost": 3}, "cost", "cost must be a MigrationCost"),
    ({"fault": "boom"}, "fault", "fault must be a callable"),
]


@pytest.mark.parametrize(("kw", "argument", "message"), BAD)
def test_the_check_names_the_bad_argument(
    kw: dict[str, object], argument: str, message: str
) -> None:
    with pytest.raises(InvalidMigrationArgument, match=message) as err:
        MigrationArgs.check(**kw)  # type: ignore[arg-type]
    assert err.value.argument == argument
    assert isinstance(err.value, InvalidArgument)


def _decoding(engine: LLMEngine) -> None:
    engine.add_request("Move me along: ", SamplingParams(max_tokens=12), request_id="r")
    for _ in range(3):
        engine.step()


@pytest.mark.parametrize(("kw", "argument", "message"), BAD)
def test_the_engine_driver_refuses_bad_arguments_before_anything(
    kw: dict[str, object], argument: str, message: str
) -> None:
    src, dst = make_engine(block_size=4), make_engine(block_size=4)
    _decoding(src)
    before = (src.scheduler.snapshot(), dst.scheduler.snapshot())
    with pytest.raises(InvalidMigrationArgument, match=message) as err:
        migrate(src, dst, "r", **kw)  # type: ignore[arg-type]
    assert err.value.argument == argument
    assert (src.scheduler.snapshot(), dst.scheduler.snapshot()) == before
    assert src.books.has_request("r") and not dst.books.has_request("r")
    with pytest.raises(InvalidMigrationArgument, match="one engine"):
        migrate(src, src, "r")


def test_the_phased_migration_uses_the_same_check() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_blocks=16)
    a, b = Stepper(cfg, memory=True), Stepper(cfg, memory=True)
    with pytest.raises(InvalidMigrationArgument, match="chunk_blocks must be an int >= 1") as err:
        PhasedMigration(a.sched, b.sched, "r", with_kv=False, link=MemoryLink(a, b), chunk_blocks=0)
    assert err.value.argument == "chunk_blocks"


def test_the_source_changed_means_tokens_status_or_gone() -> None:
    """A prefill chunk is no change (its tokens and status hold); a decoded token is, a
    preemption is (another status), and so is leaving the scheduler."""
    cfg = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=4, block_size=4, num_blocks=16)
    a = Stepper(cfg)
    a.add(Request("r", list(range(1, 11)), StopParams(4, ignore_eos=True)))
    a.step()  # 4 of 10 prompt tokens computed
    state = export(a.sched, "r").state
    assert not source_changed(a.sched, state)
    a.step()  # 8 of 10: another chunk, the same tokens and status
    assert a.sched.requests["r"].num_computed_tokens == 8
    assert not source_changed(a.sched, state)
    a.step()  # the prompt's last chunk and the first token
    assert source_changed(a.sched, state)
    state = export(a.sched, "r").state
    a.sched.abort("r")
    assert source_changed(a.sched, state)
