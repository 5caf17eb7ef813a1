"""The host (CPU) block pool (ref/kv/host_pool.py): where swapped-out KV waits.

Swap-out copies a table in, release gives it back, a failed swap quarantines its blocks;
a rolled-back step restores the pool exactly (ATOMIC), and bad calls name the request
and the operation (docs/ARCHITECTURE.md, "Invariants").
"""

from __future__ import annotations

import pytest

from refserve.errors import DuplicateRequest, InvalidArgument, OutOfBlocks, UnknownRequest
from refserve.kv.host_pool import HostPool
from refserve.kv.pool import BlockCopy
from refserve.spec import EngineSnapshot, PoolSnapshot, RequestSnapshot
from refserve.spec.atomic import check_atomic


def _engine(host: PoolSnapshot | None, *requests: RequestSnapshot) -> EngineSnapshot:
    device = PoolSnapshot(4, 2, (0, 0, 0, 0), (0, 1, 2, 3), ())
    return EngineSnapshot(tuple(requests), device, host)


def test_host_pool_swap_out_release_and_quarantine() -> None:
    host = HostPool(4, 2)
    copies = host.swap_out("a", [7, 3], 3, [1, 2, 3, 9])
    assert copies == (BlockCopy(7, 0), BlockCopy(3, 1))
    t = host.table("a")
    assert t.block_ids == (0, 1) and t.num_stored == 3 and t.token_ids == (1, 2, 3)
    assert host.num_free_blocks == 2 and not host.can_hold(5) and host.can_hold(4)
    host.begin()
    host.release("a")
    # Released inside the step: not reusable by this step's swap-outs.
    assert host.num_free_blocks == 2
    with pytest.raises(OutOfBlocks):
        host.swap_out("b", [1, 2, 3], 5, [0] * 5)
    host.commit()
    assert host.num_free_blocks == 4
    assert host.snapshot().free_queue == (2, 3, 0, 1)


def test_host_pool_rollback_is_exact() -> None:
    host = HostPool(5, 2)
    host.swap_out("a", [1], 1, [4])
    before = host.snapshot()
    host.begin()
    host.release("a")
    host.swap_out("b", [2, 3], 4, [0, 1, 2, 3])
    host.swap_out("c", [4, 5], 3, [0, 1, 2])
    host.rollback()
    assert host.snapshot() == before
    assert check_atomic(_engine(before), _engine(host.snapshot())) == []


def test_host_pool_rejects_bad_calls() -> None:
    host = HostPool(2, 2)
    host.swap_out("a", [1], 2, [1, 2])
    with pytest.raises(DuplicateRequest):
        host.swap_out("a", [1], 2, [1, 2])
    with pytest.raises(InvalidArgument, match="device blocks"):
        host.swap_out("b", [1, 2], 2, [1, 2])
    with pytest.raises(UnknownRequest):
        host.release("zz")
    with pytest.raises(UnknownRequest):
        host.table("zz")
    with pytest.raises(InvalidArgument):
        HostPool(-1, 2)


@pytest.mark.mutation_kill
def test_host_pool_error_messages_name_the_request_and_the_call() -> None:
    host = HostPool(2, 2)
    with pytest.raises(UnknownRequest) as e1:
        host.table("zz")
    assert str(e1.value) == "host table: unknown request id 'zz'"
    with pytest.raises(UnknownRequest) as e2:
        host.release("zz")
    assert str(e2.value) == "release (no host table): unknown request id 'zz'"
    host.swap_out("a", [5], 2, [1, 2])
    with pytest.raises(DuplicateRequest) as e3:
        host.swap_out("a", [5], 2, [1, 2])
    assert str(e3.value) == "swap_out: request id 'a' is already in use"
    with pytest.raises(OutOfBlocks) as e4:
        host.swap_out("b", [6, 7], 3, [1, 2, 3])
    assert str(e4.value) == "request 'b' needs 2 free KV blocks, 1 are free"


@pytest.mark.mutation_kill
def test_host_pool_refuses_a_bad_size_by_name() -> None:
    for bad in (-1, "4", 2.0, True):
        with pytest.raises(InvalidArgument) as e:
            HostPool(bad, 2)  # type: ignore[arg-type]
        assert str(e.value) == f"num_host_blocks must be an int >= 0, got {bad!r}"
