"""The in-process replica (ref/cluster/replica.py): its load figures read the engine's
state as :class:`LoadFigures` documents them, it satisfies the :class:`Replica`
protocol, and its snapshot is what its events replay to."""

from __future__ import annotations

from cluster_helpers import config, replica

from refserve.cluster import CacheSnapshot, LoadFigures, Replica
from refserve.core.cost import StepCost
from refserve.model.sampler import SamplingParams
from refserve.spec.events import replay
from refserve.spec.snapshot import RequestStatus


def _figures(f: LoadFigures) -> tuple[int, ...]:
    return (
        f.num_waiting,
        f.num_running,
        f.num_decoding,
        f.num_paused,
        f.prefill_backlog_tokens,
        f.kv_blocks_used,
    )


def test_load_figures_follow_the_requests() -> None:
    rep = replica(config(4, 16, 16, max_num_seqs=2))
    assert isinstance(rep, Replica)
    engine = rep.engine
    for k, n in enumerate((5, 6, 9)):
        engine.add_request(list(range(1, n + 1)), SamplingParams(max_tokens=8), request_id=f"r{k}")
    f = rep.load()
    assert _figures(f) == (3, 0, 0, 0, 20, 0)
    assert (f.kv_blocks_total, f.max_num_seqs, f.token_budget, f.block_size) == (16, 2, 16, 4)
    assert f.cost == StepCost()  # no cost model given: the defaults
    rep.step()
    # Two seats: r0 and r1 prefilled whole and took their first token (6 and 7 tokens,
    # two blocks each); r2 waits with its 9 tokens.
    assert _figures(rep.load()) == (1, 2, 2, 0, 9, 4)
    engine.pause("r0", "device")
    assert _figures(rep.load()) == (1, 1, 1, 1, 9, 4)  # a paused request keeps its blocks
    engine.abort("r0")
    while rep.has_work:
        rep.step()
    assert _figures(rep.load()) == (0, 0, 0, 0, 0, 0)  # cached blocks nobody holds are free


def test_a_given_cost_model_and_the_snapshot() -> None:
    cost = StepCost(1.0, 0.25, 0.5)
    rep = replica(config(4, 16, 16))
    rep = type(rep)(rep.engine, cost=cost)
    assert rep.load().cost == cost
    rep.add_request(list(range(1, 14)), SamplingParams(max_tokens=3), "s")
    events = []
    while rep.has_work:
        rep.step()
        events += rep.drain_cache_events()
    snap = rep.cache_snapshot()
    held, problems = replay((), events, 0)
    assert problems == [] and snap.next_seq == len(events) > 0
    assert isinstance(snap, CacheSnapshot)
    assert dict(snap.entries) == {k: e.block_id for k, e in held.items()}
    assert rep.prefix_hit_tokens(list(range(1, 14))) == 12
    assert rep.request_ids() == ()


def test_a_preempted_request_counts_all_its_tokens_as_backlog() -> None:
    # Six blocks of 4 for two requests growing to 17 tokens each: one is preempted.
    rep = replica(config(4, 6, 16, max_num_seqs=2))
    for k in range(2):
        rep.add_request([3, 4, 5, 6, 7 + k], SamplingParams(max_tokens=12), f"p{k}")
    sched = rep.engine.scheduler
    seen = False
    while rep.has_work and not seen:
        rep.step()
        preempted = [r for r in sched.requests.values() if r.status is RequestStatus.PREEMPTED]
        if preempted and not any(
            r.status is RequestStatus.PREFILLING for r in sched.requests.values()
        ):
            (victim,) = preempted
            assert victim.num_tokens > victim.num_prompt_tokens  # it had decoded
            f = rep.load()
            # Recompute: every token it holds is prefill work again.
            assert (f.num_waiting, f.num_running, f.num_decoding) == (1, 1, 1)
            assert f.prefill_backlog_tokens == victim.num_tokens
            seen = True
    assert seen
