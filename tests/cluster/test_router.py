"""The routing policies on constructed loads (ref/cluster/router.py; docs/CLUSTER.md,
"Routing policies"): each picks what its documented rule says, the figures of the
decision are the documented formulas, and bad input is a typed error that changes
nothing (the round-robin cursor included)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from refserve.cluster import LoadFigures, Router, RoutingPolicy, UnknownPolicy, UnknownReplica
from refserve.cluster.router import load_score, predicted_ttft_ms
from refserve.core.cost import StepCost
from refserve.errors import InvalidArgument

COST = StepCost(2.0, 0.5, 1.0)
IDLE = LoadFigures(
    num_waiting=0,
    num_running=0,
    num_decoding=0,
    num_paused=0,
    prefill_backlog_tokens=0,
    kv_blocks_used=0,
    kv_blocks_total=100,
    max_num_seqs=8,
    token_budget=64,
    block_size=16,
    cost=COST,
)


def _load(**kw: int) -> LoadFigures:
    return replace(IDLE, **kw)


def _route(
    router: Router, loads: dict[int, LoadFigures], hits: dict[int, int], n: int = 100
) -> int:
    d = router.route("r", n, loads, hits)
    assert d.policy is router.policy and d.num_prompt_tokens == n
    assert [f.replica for f in d.figures] == sorted(loads)
    for f in d.figures:  # the figures are the documented formulas
        assert f.load == load_score(loads[f.replica])
        assert f.hit_tokens == hits.get(f.replica, 0)
        assert f.predicted_ttft_ms == predicted_ttft_ms(loads[f.replica], n, f.hit_tokens)
    assert d.prefix_hit_tokens == hits.get(d.replica, 0)
    return d.replica


def test_the_load_and_ttft_formulas() -> None:
    f = _load(num_waiting=2, num_running=4, num_decoding=3, kv_blocks_used=25)
    assert load_score(f) == 6 / 8 + 25 / 100
    g = _load(num_decoding=4, prefill_backlog_tokens=100)
    # Q = 100 + 50 - 10 = 140 tokens, 60 a step (64 less 4 decodes): 3 steps of 2 + 4 ms.
    assert predicted_ttft_ms(g, 50, 10) == 3 * (2 + 4) + 0.5 * 140
    # Decodes filling the budget still leave one prefill token a step.
    h = _load(num_decoding=64, token_budget=64)
    assert predicted_ttft_ms(h, 3, 0) == 3 * (2 + 64) + 0.5 * 3


def test_round_robin_cycles_in_id_order_and_moves_only_when_accepted() -> None:
    router = Router("round_robin")
    loads = {2: IDLE, 0: _load(num_waiting=8), 5: IDLE}
    picks = []
    for _ in range(4):
        d = router.route("r", 10, loads, {})
        assert router.route("r", 10, loads, {}).replica == d.replica  # route alone is pure
        router.accepted(d)
        picks.append(d.replica)
    assert picks == [0, 2, 5, 0]  # load and hits play no part
    del loads[2]  # a replica gone: the cycle goes on over the others
    assert _route(router, loads, {}) == 5


def test_least_loaded_weighs_seats_and_memory() -> None:
    router = Router("least_loaded")
    # Replica 0: 2 of 8 seats, 10 % KV (0.35); replica 1: 1 seat, 40 % KV (0.525).
    loads = {0: _load(num_running=2, kv_blocks_used=10), 1: _load(num_waiting=1, kv_blocks_used=40)}
    assert _route(router, loads, {1: 96}) == 0
    loads[0] = _load(num_running=4, kv_blocks_used=10)  # 0.6 now
    assert _route(router, loads, {}) == 1
    assert _route(router, {3: IDLE, 1: IDLE}, {}) == 1  # a tie: the lower id


def test_prefix_aware_takes_the_best_hit_within_the_margin() -> None:
    router = Router("prefix_aware", balance_margin=0.25)
    busy = _load(num_running=1)  # load 0.125: within 0.25 of an idle replica
    assert _route(router, {0: IDLE, 1: busy, 2: IDLE}, {1: 64, 2: 32}) == 1
    busier = _load(num_running=3)  # 0.375: beyond the margin, its hit is passed over
    assert _route(router, {0: IDLE, 1: busier, 2: IDLE}, {1: 64, 2: 32}) == 2
    # No hit anywhere: the least loaded; equal hits: the lesser load.
    assert _route(router, {0: busy, 1: IDLE}, {}) == 1
    assert _route(router, {0: busy, 1: IDLE}, {0: 16, 1: 16}) == 1
    assert _route(Router("prefix_aware", balance_margin=1.0), {0: IDLE, 1: busier}, {1: 16}) == 1


def test_slo_aware_predicts_ttft_from_each_cost_model() -> None:
    router = Router("slo_aware")
    # Replica 0 has fewer requests (least loaded) but a long prefill queued.
    loads = {
        0: _load(num_waiting=1, prefill_backlog_tokens=500),
        1: _load(num_running=3, num_decoding=3),
    }
    assert Router("least_loaded").route("r", 100, loads, {}).replica == 0
    assert _route(router, loads, {}) == 1
    # A cached prefix shortens the prefill: 90 of 100 cached on the busier replica.
    loads = {0: _load(num_decoding=8), 1: _load(num_decoding=8, num_running=8)}
    assert _route(router, loads, {}) == 0
    assert _route(router, loads, {1: 90}) == 1
    # A replica with a faster cost model wins an equal queue.
    fast = replace(IDLE, cost=StepCost(1.0, 0.1, 0.5))
    assert _route(router, {0: IDLE, 1: fast}, {}) == 1


@pytest.mark.parametrize("name", ["random", "", "Round_Robin", "prefix-aware"])
def test_an_unknown_policy_is_a_typed_error(name: str) -> None:
    with pytest.raises(UnknownPolicy, match="round_robin, least_loaded, prefix_aware, slo_aware"):
        Router(name)


def test_bad_input_is_a_typed_error_and_moves_nothing() -> None:
    for margin in (-0.1, math.nan, math.inf, True, "0.1"):
        with pytest.raises(InvalidArgument, match="balance_margin"):
            Router("prefix_aware", balance_margin=margin)  # type: ignore[arg-type]
    router = Router(RoutingPolicy.ROUND_ROBIN)
    router.accepted(router.route("r", 1, {0: IDLE, 1: IDLE}, {}))
    with pytest.raises(InvalidArgument, match="no replica"):
        router.route("r", 4, {}, {})
    for n in (0, -3, 2.5, True):
        with pytest.raises(InvalidArgument, match=r"num_prompt_tokens|at least one token"):
            router.route("r", n, {0: IDLE}, {})  # type: ignore[arg-type]
    with pytest.raises(UnknownReplica, match="unknown replica 7"):
        router.route("r", 4, {0: IDLE, 1: IDLE}, {7: 4})
    assert router.route("r", 4, {0: IDLE, 1: IDLE}, {}).replica == 1  # the cursor held


def _loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``statement``."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def _heavy(loaded: set[str]) -> list[str]:
    """The engine's modules and torch among ``loaded``."""
    return sorted(
        m
        for m in loaded
        if m.split(".")[0] == "torch" or m == "refserve.engine" or m.startswith("refserve.engine.")
    )


def test_the_router_depends_on_records_only() -> None:
    """The router is a pure function of records: importing it (the package's
    ``__init__`` included) loads neither the engine nor torch."""
    loaded = _loaded_after("import refserve.cluster.router")
    assert "refserve.cluster.router" in loaded and "refserve.cluster.records" in loaded
    assert _heavy(loaded) == []


def test_the_import_check_sees_the_engine_where_it_is_loaded() -> None:
    """The same reading finds the engine and torch behind the replica interface (an
    in-process replica drives an LLMEngine): the check above can fail."""
    heavy = _heavy(_loaded_after("import refserve.cluster.replica"))
    assert "refserve.engine.llm_engine" in heavy and "torch" in heavy
