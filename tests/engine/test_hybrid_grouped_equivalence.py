"""A hybrid sliding-window model on the GROUPED KV pool is token-for-token transformers'.

The model is the ``hybrid`` oracle (conftest.py): transformers' Qwen2 with per-layer
``layer_types``, sliding:full 1:1 with a window ``W`` of 8 (a multiple of the block size
4) and 5:1 with ``W`` = 13 (not one). Here the engine runs it with
``SchedulerConfig.kv_groups`` equal to the model's layout (``kv_groups(cfg)``: a full
group and a window group of ``W``), so the pool keeps a table per layer group, the
window group lets its blocks go as they leave the window, and each layer reads and
writes through its own group's table (ref/model/executor.py). Every run checks the
engine's invariants, the grouped pool's rules (spec/groups.py) included, after every
step.

Greedy outputs equal ``generate(do_sample=False)`` under chunked prefill (budgets 5 and
16, logit by logit), prefix reuse (requests sharing a prompt prefix arriving after the
first finished, served from the cache), preemption by recompute and by swap to a host
pool (a pool too small for every request at once; a swap moves each group's blocks the
next query reads, and brings them back into every group's rebuilt table), a tool wait
on the host, migration by recompute and speculative decoding with n-gram drafts (some
rejected, their K/V cut from every group's table); each run also shows the window group's tables
holding null places, memory given back while the requests ran. A failed
step restores every layer's K/V, and the Triton kernels read the window group's tables
as the torch backend does.

The checks can fail: garbage in a layer's own group's blocks changes the tokens and in
the other group's does not (each layer reads its group's table); with the window group
planted to free one block too early (its release before an allocation reaching one
block further), the executor refuses to read a released place (``NullBlockAccess``);
with that guard taken away, the engine's step checks flag the request (rule
``window-early``); with the checks off too, the tokens are not transformers' any more.
Released further, to the block a token is written to, the step's inputs refuse it. A
swap-out planted to leave each window group's last block uncopied passes the checks
(the books are right) and changes the tokens. A truncation of rejected drafts planted to
cut the first group's table only is named by the step checks (``group-tables``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hf_oracle import VOCAB, HFOracle, random_prompt
from test_engine_equivalence import ATOL, RTOL

import refserve.model.executor as executor_module
from refserve.core.config import SchedulerConfig
from refserve.core.engine_core import InvariantViolation
from refserve.core.inputs import GroupInputs, ModelInputs, NullBlockAccess
from refserve.core.swap import KVRetention
from refserve.engine import migration
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.errors import InvalidArgument
from refserve.kv import BlockPool
from refserve.kv import groups as groups_module
from refserve.kv import truncation as truncation_module
from refserve.kv.groups import GroupBlocks, GroupedPool
from refserve.kv.host_pool import HostPool
from refserve.kv.pool import BlockCopy
from refserve.model.config import (
    SLIDING_ATTENTION,
    kv_groups,
    layer_groups,
    tiny_config,
)
from refserve.model.proposers import NgramProposer, Proposer
from refserve.model.sampler import SamplingParams
from refserve.spec.groups import GROUP_TABLES, NULL_BLOCK, WINDOW_EARLY, GroupKind, KVGroup

BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # Two cores are shared: one torch thread keeps the runs' time steady.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Job:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrive_step: int = 0


@dataclass
class Run:
    engine: LLMEngine
    finals: dict[str, RequestOutput] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    most_nulls: int = 0  # the most null places the window group's tables held after a step
    # The window group's first swapped place of every host table seen after a step.
    swapped_window_starts: set[int] = field(default_factory=set)
    # Verifications whose request's window table held null places after the step.
    verified_with_nulls: int = 0


def grouped(hybrid: HFOracle, **fields: object) -> SchedulerConfig:
    """A scheduler config with the model's layer groups: the grouped pool."""
    return SchedulerConfig(block_size=BLOCK, kv_groups=kv_groups(hybrid.config), **fields)  # type: ignore[arg-type]


def jobs_of(seed: int, lengths: Sequence[int], max_tokens: Sequence[int]) -> list[Job]:
    g = torch.Generator().manual_seed(seed)
    return [
        Job(f"r{i}", random_prompt(g, n), m, arrive_step=i)
        for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))
    ]


def null_places(engine: LLMEngine) -> int:
    """Null places in the window group's tables of every live request."""
    pool = engine.scheduler.pool
    assert isinstance(pool, GroupedPool)
    rids = [rid for rid in engine.scheduler.requests if pool.has_request(rid)]
    return sum(list(t).count(NULL_BLOCK) for t in pool.group_table_views(1, rids))


def drive(
    hybrid: HFOracle,
    jobs: Sequence[Job],
    cfg: SchedulerConfig,
    *,
    record_logits: bool = False,
    check_invariants: bool = True,
    arrive: Callable[[Run, Job], bool] | None = None,
    proposer: Proposer | None = None,
) -> Run:
    """Run ``jobs`` (each added at its ``arrive_step``, or once ``arrive`` says so) to
    the end, recording the final outputs and the null places after every step."""
    engine = LLMEngine(
        str(hybrid.path),
        scheduler_config=cfg,
        check_invariants=check_invariants,
        proposer=proposer,
    )
    pool = engine.scheduler.pool
    assert isinstance(pool, GroupedPool)
    run = Run(engine)
    if record_logits:

        def hook(rids: tuple[str, ...], logits: torch.Tensor) -> None:
            for i, rid in enumerate(rids):
                run.logits.setdefault(rid, []).append(logits[i].clone())

        engine.executor.logits_hook = hook
    pending = list(jobs)
    step = 0
    while pending or engine.has_unfinished:
        for j in list(pending):
            if arrive(run, j) if arrive is not None else j.arrive_step <= step:
                pending.remove(j)
                engine.add_request(
                    j.prompt, SamplingParams(max_tokens=j.max_tokens), request_id=j.rid
                )
        for out in engine.step():
            if out.finished:
                run.finals[out.request_id] = out
        run.most_nulls = max(run.most_nulls, null_places(engine))
        run.verified_with_nulls += sum(
            1 for rid in engine.steps[-1].plan.drafts
            if pool.has_request(rid) and NULL_BLOCK in pool.block_tables(rid)[1]
        )  # fmt: skip
        host = engine.scheduler.host
        run.swapped_window_starts |= {
            host.table(rid).groups[1].first for rid in engine.scheduler.requests
            if host.has_request(rid)
        }  # fmt: skip
        step += 1
        assert step < 2000, "the run does not finish"
    return run


def assert_matches_hf(hybrid: HFOracle, run: Run, jobs: Sequence[Job]) -> None:
    for j in jobs:
        want = hybrid.greedy(j.prompt, j.max_tokens)
        assert run.finals[j.rid].token_ids == want, (
            f"{j.rid}: {run.finals[j.rid].token_ids} != HF {want}"
        )


# ------------------------------------------------------------------- the layout
def test_the_layout_comes_from_the_model(hybrid: HFOracle) -> None:
    cfg = hybrid.config
    window = cfg.sliding_window
    assert window is not None
    assert kv_groups(cfg) == (KVGroup(GroupKind.FULL), KVGroup(GroupKind.WINDOW, window))
    assert layer_groups(cfg) == tuple(1 if k == SLIDING_ATTENTION else 0 for k in cfg.layer_types)
    dense = tiny_config()
    assert kv_groups(dense) == (KVGroup(GroupKind.FULL),)
    assert layer_groups(dense) == (0,) * dense.num_layers
    # Every layer sliding: group 0 (the scheduler's table) stays, read by no layer.
    sliding = dataclasses.replace(cfg, layer_types=(SLIDING_ATTENTION,) * cfg.num_layers)
    assert kv_groups(sliding) == kv_groups(cfg) and set(layer_groups(sliding)) == {1}


def test_the_engine_takes_the_models_layout_only(hybrid: HFOracle) -> None:
    window = hybrid.config.sliding_window
    assert window is not None
    other = (KVGroup(GroupKind.FULL), KVGroup(GroupKind.WINDOW, window + 1))
    with pytest.raises(InvalidArgument) as e:
        LLMEngine(str(hybrid.path), scheduler_config=SchedulerConfig(kv_groups=other))
    assert f"(full, window {window + 1})" in str(e.value)  # what was given
    assert f"(full, window {window})" in str(e.value)  # and the model's
    with pytest.raises(InvalidArgument, match=r"model's KV layout .* is \(full, window"):
        LLMEngine(
            str(hybrid.path),
            scheduler_config=SchedulerConfig(kv_groups=(KVGroup(GroupKind.FULL),)),
        )
    # grouped_kv=True fills the layout in; the default stays the plain pool.
    assert isinstance(LLMEngine(str(hybrid.path), grouped_kv=True).scheduler.pool, GroupedPool)
    assert not isinstance(LLMEngine(str(hybrid.path)).scheduler.pool, GroupedPool)
    assert LLMEngine(str(hybrid.path), grouped_kv=True).scheduler.config.kv_groups == kv_groups(
        hybrid.config
    )
    # A dense model's layout is one group: the plain pool, whichever way it is asked for.
    dense = LLMEngine("tiny", grouped_kv=True)
    assert not isinstance(dense.scheduler.pool, GroupedPool)
    with pytest.raises(InvalidArgument, match=r"kv_groups is \(full, window"):
        LLMEngine("tiny", scheduler_config=SchedulerConfig(kv_groups=other))
    with pytest.raises(InvalidArgument, match="grouped_kv must be True or False"):
        LLMEngine("tiny", grouped_kv="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("budget", [5, 16])
def test_chunked_prefill_matches_transformers_logit_by_logit(hybrid: HFOracle, budget: int) -> None:
    jobs = jobs_of(12, [23, 41, 30], [22, 20, 21])
    run = drive(hybrid, jobs, grouped(hybrid, max_num_batched_tokens=budget), record_logits=True)
    assert_matches_hf(hybrid, run, jobs)
    chunks = [
        n
        for s in run.engine.steps
        for n, p in zip(s.plan.num_new_tokens, s.plan.is_prefill, strict=True)
        if p
    ]
    assert max(chunks) <= budget and len(chunks) > len(jobs)
    for j in jobs:
        full = j.prompt + list(run.finals[j.rid].token_ids)
        ref = hybrid.logits(full)[len(j.prompt) - 1 : len(full) - 1]
        torch.testing.assert_close(torch.stack(run.logits[j.rid]), ref, atol=ATOL, rtol=RTOL)
    assert run.most_nulls > 0  # window blocks went back to the pool while the requests ran


def test_shared_prefix_after_the_first_finished_is_served_from_the_cache(hybrid: HFOracle) -> None:
    g = torch.Generator().manual_seed(13)
    prefix = random_prompt(g, 42)  # 10 full blocks of 4 and a partial one
    jobs = [
        Job(f"p{i}", prefix + torch.randint(3, VOCAB, (k,), generator=g).tolist(), m)
        for i, (k, m) in enumerate([(6, 22), (3, 24), (11, 20)])
    ]
    run = drive(
        hybrid,
        jobs,
        grouped(hybrid, max_num_batched_tokens=16, num_blocks=256),
        arrive=lambda run, j: j.rid == "p0" or "p0" in run.finals,
    )
    assert_matches_hf(hybrid, run, jobs)
    assert run.finals["p0"].metrics.num_cached_tokens == 0
    for j in jobs[1:]:
        # Every full block of the shared prefix: the full group's whole chain and the
        # window group's last blocks (the ones before them skipped, null places).
        assert run.finals[j.rid].metrics.num_cached_tokens == 40
    assert run.most_nulls > 0


def test_preemption_by_recompute_matches_transformers(hybrid: HFOracle) -> None:
    # 24 blocks of 4 tokens for four requests arriving together, each of up to 50 tokens
    # (12 full-group blocks and the window's): decoding outgrows the pool.
    jobs = jobs_of(14, [12, 16, 10, 14], [36, 32, 38, 34])
    for j in jobs:
        j.arrive_step = 0
    run = drive(hybrid, jobs, grouped(hybrid, max_num_batched_tokens=32, num_blocks=24))
    assert_matches_hf(hybrid, run, jobs)
    assert run.engine.num_preemptions >= 2
    assert not [rid for s in run.engine.steps for rid in s.plan.swapped_out]
    assert run.most_nulls > 0


def swapping(hybrid: HFOracle) -> tuple[list[Job], SchedulerConfig]:
    """The recompute test's four requests in 24 blocks, preempted by swap to a host
    pool that holds any victim."""
    jobs = jobs_of(14, [12, 16, 10, 14], [36, 32, 38, 34])
    for j in jobs:
        j.arrive_step = 0
    cfg = grouped(
        hybrid,
        max_num_batched_tokens=32,
        num_blocks=24,
        num_host_blocks=48,
        preemption_mode="swap",
    )
    return jobs, cfg


def test_preemption_by_swap_matches_transformers(hybrid: HFOracle) -> None:
    """Victims go to the host with, in each group, the blocks their next query reads
    (the window group's from the one holding window_start on) and come back into
    tables rebuilt for every group; every layer then reads its own group's K/V."""
    jobs, cfg = swapping(hybrid)
    run = drive(hybrid, jobs, cfg)
    assert_matches_hf(hybrid, run, jobs)
    plans = [s.plan for s in run.engine.steps]
    out = [rid for p in plans for rid in p.swapped_out]
    back = [rid for p in plans for rid in p.swapped_in]
    assert len(out) >= 2 and sorted(out) == sorted(back), (out, back)
    assert not [p for p in plans if set(p.preempted) - set(p.swapped_out)]  # none recomputed
    assert run.engine.executor.swap_out_bytes > 0 and run.engine.executor.swap_in_bytes > 0
    # Some victim's window blocks before its window stayed behind, freed, not copied.
    assert max(run.swapped_window_starts) > 0
    assert run.most_nulls > 0


def test_a_swap_that_leaves_a_window_block_uncopied_changes_the_tokens(
    hybrid: HFOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planted bug: every swap-out copies all but each window group's last block
    (the most recent tokens; the host table still claims it). The books stay right, so
    the engine's checks pass, and the tokens are not transformers' any more."""
    honest = HostPool.swap_out_groups

    def uncopied(
        self: HostPool,
        request_id: str,
        device: Sequence[GroupBlocks],
        num_stored: int,
        token_ids: Sequence[int],
    ) -> tuple[BlockCopy, ...]:
        copies = honest(self, request_id, device, num_stored, token_ids)
        last = {d.block_ids[-1] for d in device[1:] if d.block_ids}
        return tuple(c for c in copies if c.src not in last)

    monkeypatch.setattr(HostPool, "swap_out_groups", uncopied)
    jobs, cfg = swapping(hybrid)
    run = drive(hybrid, jobs, cfg)
    assert [rid for s in run.engine.steps for rid in s.plan.swapped_in]
    differ = [
        j.rid for j in jobs if run.finals[j.rid].token_ids != hybrid.greedy(j.prompt, j.max_tokens)
    ]
    assert differ, "a window block left uncopied changed no token"


def test_a_tool_wait_on_the_host_matches_transformers(hybrid: HFOracle) -> None:
    """An agent turn paused with retention ``host`` leaves the device with each group's
    blocks its next query reads, comes back with the tool's tokens, and its second turn
    is transformers' continuation of the whole conversation."""
    g = torch.Generator().manual_seed(18)
    prompt = random_prompt(g, 21)
    other = random_prompt(g, 9)
    tool = torch.randint(3, VOCAB, (5,), generator=g).tolist()
    cfg = grouped(hybrid, max_num_batched_tokens=16, num_host_blocks=32)
    engine = LLMEngine(str(hybrid.path), scheduler_config=cfg, check_invariants=True)
    engine.add_request(prompt, SamplingParams(max_tokens=40), request_id="a")
    engine.add_request(other, SamplingParams(max_tokens=20), request_id="o")
    turn1: list[int] = []
    finals: dict[str, RequestOutput] = {}

    def step() -> list[RequestOutput]:
        outs = engine.step()
        finals.update((o.request_id, o) for o in outs if o.finished)
        return outs

    while len(turn1) < 10:
        turn1 += [t for o in step() if o.request_id == "a" for t in o.new_token_ids]
    assert engine.pause("a", "host") is KVRetention.HOST
    step()
    host = engine.scheduler.host
    # 30 tokens of KV: the query at 30 reads from 30 - W + 1, past the window's first
    # blocks, which stayed behind.
    assert host.has_request("a") and host.table("a").groups[1].first > 0
    engine.resume("a", tool, SamplingParams(max_tokens=8))
    while engine.has_unfinished:
        step()
    plans = [s.plan for s in engine.steps]
    assert [r for p in plans for r in p.swapped_out] == ["a"]
    assert [r for p in plans for r in p.swapped_in] == ["a"]
    assert finals["o"].token_ids == hybrid.greedy(other, 20)
    assert tuple(turn1) == hybrid.greedy(prompt, 10)
    assert finals["a"].token_ids == hybrid.greedy([*prompt, *turn1, *tool], 8)


def test_ngram_speculation_matches_transformers(hybrid: HFOracle) -> None:
    """Speculation never changes a greedy token: n-gram drafts (32-token outputs, so the
    small random model's greedy text loops and lookup finds drafts), some accepted and
    some rejected, verified while the window group holds null places. Each verification
    allocates its drafts' positions in every group; the commit cuts every group's table
    back to the accepted length (the step checks hold after every step)."""
    g = torch.Generator().manual_seed(19)
    jobs = [Job(f"s{i}", random_prompt(g, 7 + 6 * i), 32, arrive_step=2 * i) for i in range(3)]
    run = drive(hybrid, jobs, grouped(hybrid, max_num_batched_tokens=16), proposer=NgramProposer(3))
    assert_matches_hf(hybrid, run, jobs)
    outcomes = [v for s in run.engine.steps for v in s.outcome.verified.values()]
    drafted = sum(v.num_drafts for v in outcomes)
    accepted = sum(v.num_accepted for v in outcomes)
    assert 0 < accepted < drafted, (accepted, drafted)  # some drafts right, some wrong
    assert run.verified_with_nulls > 0
    assert run.most_nulls > 0


def test_a_truncation_that_skips_the_window_group_is_caught(
    hybrid: HFOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planted bug: rejected drafts cut from the first group's table only, so the
    window group keeps their positions (and any block that held only them). The step
    checks name the request's groups stored at two lengths (rule ``group-tables``)."""

    def first_only(pool: GroupedPool, request_id: str, num_stored: int) -> list[int]:
        table = pool.tables.table(request_id, "truncate")
        return truncation_module._cut(pool, request_id, table, num_stored)

    monkeypatch.setattr(truncation_module, "_truncate_groups", first_only)
    g = torch.Generator().manual_seed(19)
    jobs = [Job(f"s{i}", random_prompt(g, 7 + 6 * i), 32, arrive_step=2 * i) for i in range(3)]
    with pytest.raises(InvariantViolation) as e:
        drive(hybrid, jobs, grouped(hybrid, max_num_batched_tokens=16), proposer=NgramProposer(3))
    assert any(v.rule == GROUP_TABLES for v in e.value.violations), e.value


def test_migration_by_recompute_matches_transformers(hybrid: HFOracle) -> None:
    """A request moved mid-decode between two grouped engines by recompute (by transfer:
    tests/engine/test_hybrid_grouped_migration.py)."""
    g = torch.Generator().manual_seed(16)
    prompt = random_prompt(g, 30)
    engines = [
        LLMEngine(
            str(hybrid.path),
            scheduler_config=grouped(hybrid, max_num_batched_tokens=b),
            check_invariants=True,
        )
        for b in (5, 16)
    ]
    src, dst = engines
    rid = src.add_request(prompt, SamplingParams(max_tokens=24), request_id="m")
    tokens: list[int] = []
    while len(tokens) < 10:
        for out in src.step():
            tokens.extend(out.new_token_ids)
    assert null_places(src) > 0
    report = migration.migrate(src, dst, rid, kv="recompute")
    assert report.decision.mode.value == "recompute"
    final = None
    while dst.has_unfinished:
        for out in dst.step():
            tokens.extend(out.new_token_ids)
            final = out if out.finished else final
    assert final is not None and tuple(tokens) == hybrid.greedy(prompt, 24)
    assert not src.scheduler.requests


# ------------------------------------------------------------------- the checks can fail
def _early_by_one(monkeypatch: pytest.MonkeyPatch, blocks: int = 1) -> None:
    """Plant the bug: before an allocation at ``L``, a window group releases its blocks
    up to and including the one holding ``window_start(L, W)``, which the query at ``L``
    still reads (the release's bound ``blocks`` too far; lookups are left as they are)."""
    real = groups_module._release_before

    def early(pool: BlockPool, request_id: str, end: int) -> None:
        real(pool, request_id, end + blocks)

    monkeypatch.setattr(groups_module, "_release_before", early)


def _no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the executor's read guard away: null places become block 0, unchecked."""

    def unchecked(tables: np.ndarray, *_: object) -> np.ndarray:  # type: ignore[type-arg]
        return np.maximum(tables, 0)

    monkeypatch.setattr(executor_module, "window_tables", unchecked)


def test_a_window_block_freed_one_early_is_caught(
    hybrid: HFOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = jobs_of(12, [23, 41, 30], [22, 20, 21])
    cfg = grouped(hybrid, max_num_batched_tokens=16)
    _early_by_one(monkeypatch)
    # The executor refuses to read the released place, before anything is written.
    with pytest.raises(NullBlockAccess, match=r"request 'r0': a layer of window \d+ reads"):
        drive(hybrid, jobs, cfg)
    _no_guard(monkeypatch)
    # Without that guard, the engine's step checks name the request and the rule.
    with pytest.raises(InvariantViolation) as e:
        drive(hybrid, jobs, cfg)
    assert any(v.rule == WINDOW_EARLY for v in e.value.violations), e.value
    # And with the checks off too, the tokens are not transformers'.
    run = drive(hybrid, jobs, cfg, check_invariants=False)
    differ = [
        j.rid for j in jobs if run.finals[j.rid].token_ids != hybrid.greedy(j.prompt, j.max_tokens)
    ]
    assert differ, "a window block freed early changed no token"


def test_a_write_into_a_released_place_is_refused(
    hybrid: HFOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Released as far as the block the next token goes to: the step's inputs refuse
    it (its slot would be negative, which a kernel reads as "skip" or from the end)."""
    window = hybrid.config.sliding_window
    assert window is not None
    _early_by_one(monkeypatch, blocks=window // BLOCK + 2)
    # The prompt in one step, then the first decode writes into the prompt's last block.
    jobs = jobs_of(12, [23], [22])
    with pytest.raises(NullBlockAccess, match=r"request 'r0' writes position 23 into"):
        drive(hybrid, jobs, grouped(hybrid, max_num_batched_tokens=64))


def test_window_tables_refuse_a_null_place_the_window_reads() -> None:
    """The guard itself: a sequence whose queries read from position 5 with a window of
    8 (KV 12, 1 query: keys 4..11, blocks 1 and 2 of 4) may have block 0 null, not 1."""

    def inputs(table: list[int]) -> ModelInputs:
        t = np.array([table], dtype=np.int32)
        return ModelInputs(
            request_ids=("a",),
            input_ids=np.zeros(1, dtype=np.int64),
            positions=np.array([11], dtype=np.int64),
            slot_mapping=np.zeros(1, dtype=np.int64),
            query_start_loc=np.array([0, 1], dtype=np.int32),
            seq_lens=np.array([12], dtype=np.int32),
            block_tables=np.array([[7, 8, 9]], dtype=np.int32),
            sample_rows=np.zeros(1, dtype=np.int64),
            sample_request_ids=("a",),
            groups=(GroupInputs(t, np.array([4 * t[0, 2] + 3], dtype=np.int64)),),
        )

    ok = inputs([NULL_BLOCK, 5, 6])
    tables = executor_module.window_tables(ok.groups[0].block_tables, ok, 8, BLOCK)
    assert tables.tolist() == [[0, 5, 6]] and tables.dtype == np.int32
    bad = inputs([NULL_BLOCK, NULL_BLOCK, 6])
    with pytest.raises(NullBlockAccess, match=r"request 'a': .* reads logical block 1"):
        executor_module.window_tables(bad.groups[0].block_tables, bad, 8, BLOCK)
    # A window of 9 reaches position 3, in block 0: its null place is read.
    with pytest.raises(NullBlockAccess, match="logical block 0"):
        executor_module.window_tables(ok.groups[0].block_tables, ok, 9, BLOCK)


# ------------------------------------------------------------------- each layer its group's blocks
def _poisoned_run(
    hybrid: HFOracle, prompt: list[int], layers: Sequence[int], group: int, garbage: float
) -> tuple[int, ...]:
    """Greedy tokens when, right after the prefill, every slot of every block the request
    holds in ``group`` is overwritten with ``garbage`` in ``layers``' caches."""
    engine = LLMEngine(
        str(hybrid.path), scheduler_config=grouped(hybrid, num_blocks=64), check_invariants=True
    )
    rid = engine.add_request(prompt, SamplingParams(max_tokens=24))
    first = engine.step()  # the whole prompt in one step, and its first token
    assert first and len(first[0].token_ids) == 1
    pool = engine.scheduler.pool
    assert isinstance(pool, GroupedPool)
    blocks = [b for b in pool.block_tables(rid)[group] if b != NULL_BLOCK]
    assert blocks
    cache = engine.executor.cache
    for layer in layers:
        cache.key[layer][blocks] = garbage
        cache.value[layer][blocks] = garbage
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                return out.token_ids
    raise AssertionError("the request did not finish")


def test_each_layer_reads_its_own_groups_blocks(hybrid: HFOracle) -> None:
    """The window layers keep their K/V in the window group's blocks and the full layers
    in the full group's: garbage (NaN poisons any softmax that reads it) in the other
    group's blocks of a layer changes nothing, in its own group's blocks it does."""
    g = torch.Generator().manual_seed(15)
    prompt = random_prompt(g, 44)
    want = hybrid.greedy(prompt, 24)
    of = layer_groups(hybrid.config)
    sliding = [i for i, k in enumerate(of) if k == 1]
    full = [i for i, k in enumerate(of) if k == 0]
    assert _poisoned_run(hybrid, prompt, sliding, 0, float("nan")) == want
    assert _poisoned_run(hybrid, prompt, full, 1, float("nan")) == want
    assert _poisoned_run(hybrid, prompt, sliding[:1], 1, 1e3) != want
    assert _poisoned_run(hybrid, prompt, full[:1], 0, 1e3) != want


def test_a_failed_step_restores_every_groups_kv(hybrid: HFOracle) -> None:
    """A step that fails after its forward leaves every layer's cache as it was (each
    group's slots saved in its own layers), and the run then matches transformers."""
    jobs = jobs_of(17, [26, 19], [20, 22])
    engine = LLMEngine(
        str(hybrid.path),
        scheduler_config=grouped(hybrid, max_num_batched_tokens=16),
        check_invariants=True,
    )
    for j in jobs:
        engine.add_request(j.prompt, SamplingParams(max_tokens=j.max_tokens), request_id=j.rid)
    finals: dict[str, tuple[int, ...]] = {}
    for _ in range(6):  # into decoding, with window blocks already released
        for out in engine.step():
            assert not out.finished
    assert null_places(engine) > 0
    cache = engine.executor.cache
    before = [t.clone() for t in (*cache.key, *cache.value)]

    def fail(point: str) -> None:
        if point == "after_forward":
            raise RuntimeError("planted fault")

    engine.executor.fault_hook = fail
    with pytest.raises(RuntimeError, match="planted fault"):
        engine.step()
    after = [*cache.key, *cache.value]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    engine.executor.fault_hook = None
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    for j in jobs:
        assert finals[j.rid] == hybrid.greedy(j.prompt, j.max_tokens)


TRITON_CHECK = """
import torch
from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine, SamplingParams
from refserve.model.config import ModelConfig, kv_groups
from refserve.model.weights import random_weights

kinds = ("sliding_attention", "full_attention")
cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True, model_type="qwen2",
    sliding_window=5, layer_types=kinds)
w = random_weights(cfg, 3)
sc = SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=64,
    kv_groups=kv_groups(cfg))
prompts = [[1] + list(range(10, 27)), [1] + list(range(40, 51))]

def logits(backend):
    e = LLMEngine((cfg, w), scheduler_config=sc, attention_backend=backend,
        check_invariants=True)
    rows, nulls = {}, []
    e.executor.logits_hook = lambda rids, lg: [
        rows.setdefault(r, []).append(lg[i].clone()) for i, r in enumerate(rids)]
    real = e.executor.begin
    def begin(plan, inputs):
        nulls.extend(int((g.block_tables == -1).sum()) for g in inputs.groups)
        real(plan, inputs)
    e.executor.begin = begin
    e.generate(prompts, SamplingParams(max_tokens=4))
    assert max(nulls) > 0, "no window block was released"
    return torch.cat([torch.stack(rows[r]) for r in sorted(rows)])

torch.testing.assert_close(logits("triton"), logits("torch"), atol=1e-4, rtol=1e-4)
"""


def test_triton_backend_reads_the_window_groups_tables() -> None:
    """The Triton kernels on the grouped pool give the torch backend's logits, with
    window tables holding released (null) places that the executor hands them as block
    0 (a window of 5 over prompts of 12 and 18, chunked by 8; run in a subprocess:
    ``TRITON_INTERPRET`` must be set before triton is imported)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
