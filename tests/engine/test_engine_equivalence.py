"""Greedy outputs are token-for-token those of transformers' ``generate`` (the oracle).

Each scenario runs refserve's engine on the checkpoint that the ``hf`` fixture saved, with
``EngineCore(check_invariants=True)`` (every spec invariant checked after every step),
under a different batching stress, and compares each request with
``model.generate(do_sample=False)`` run alone.

Logits tolerance: fp32 on CPU, refserve's logits at each sampled step are compared with
a full (unpaged, unbatched) transformers forward over the same tokens with
``atol = 2e-5`` and ``rtol = 1e-5``. Measured differences are about 4e-6 on logits of
magnitude up to ~10 (summation-order rounding: different matmul shapes, paged gather,
batching); the closest greedy margin among the reference steps is ~1e-2, three orders of
magnitude above the tolerance, so agreement to this tolerance is what makes the
token-for-token check meaningful rather than lucky.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hf_oracle import HFOracle, random_prompt

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine, Proposer, RequestOutput
from refserve.model.sampler import SamplingParams

ATOL = 2e-5
RTOL = 1e-5


@dataclass
class Job:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrive_step: int = 0
    abort_step: int | None = None
    n: int = 1


@dataclass
class Run:
    engine: LLMEngine
    finals: dict[tuple[str, int], RequestOutput] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    max_batch: int = 0
    mixed_steps: int = 0


def run_jobs(
    hf: HFOracle,
    jobs: Sequence[Job],
    cfg: SchedulerConfig,
    *,
    record_logits: bool = False,
    proposer: Proposer | None = None,
) -> Run:
    engine = LLMEngine(str(hf.path), scheduler_config=cfg, check_invariants=True, proposer=proposer)
    run = Run(engine)
    if record_logits:

        def hook(rids: tuple[str, ...], logits: torch.Tensor) -> None:
            for i, rid in enumerate(rids):
                run.logits.setdefault(rid, []).append(logits[i].clone())

        engine.executor.logits_hook = hook
    pending = sorted(jobs, key=lambda j: j.arrive_step)
    aborts = {j.rid: j.abort_step for j in jobs if j.abort_step is not None}
    step = 0
    while pending or engine.has_unfinished:
        while pending and pending[0].arrive_step <= step:
            j = pending.pop(0)
            engine.add_request(
                j.prompt, SamplingParams(max_tokens=j.max_tokens, n=j.n), request_id=j.rid
            )
        for rid, at in list(aborts.items()):
            if at == step and engine.books.has_request(rid):
                engine.abort(rid)
                del aborts[rid]
        for out in engine.step():
            if out.finished:
                run.finals[(out.request_id, out.index)] = out
        if engine.steps and engine.steps[-1].step_index == len(engine.steps) - 1:
            plan = engine.steps[-1].plan
            run.max_batch = max(run.max_batch, len(plan.request_ids))
            if any(plan.is_prefill) and not all(plan.is_prefill):
                run.mixed_steps += 1
        step += 1
        assert step < 5000, "engine did not finish"
    # Every block is back in the pool (PROGRESS: nothing leaks after all requests end).
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks
    return run


def assert_matches_hf(hf: HFOracle, run: Run, jobs: Sequence[Job]) -> None:
    for j in jobs:
        if j.abort_step is not None:
            continue
        want = hf.greedy(j.prompt, j.max_tokens)
        for i in range(j.n):
            out = run.finals[(j.rid, i)]
            assert out.token_ids == want, f"{j.rid}[{i}]: {out.token_ids} != HF {want}"
            expected_reason = "stop" if want[-1] == hf.config.eos_token_id else "length"
            assert out.finish_reason == expected_reason


def make_jobs(seed: int, lengths: Sequence[int], max_tokens: Sequence[int]) -> list[Job]:
    g = torch.Generator().manual_seed(seed)
    return [
        Job(f"r{i}", random_prompt(g, n), m)
        for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))
    ]


def test_staggered_arrivals_continuous_batching(hf: HFOracle) -> None:
    jobs = make_jobs(1, [5, 23, 11, 40, 3, 17], [12, 6, 16, 8, 20, 10])
    for j, at in zip(jobs, [0, 0, 2, 5, 9, 14], strict=True):
        j.arrive_step = at
    run = run_jobs(
        hf, jobs, SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=128)
    )
    assert_matches_hf(hf, run, jobs)
    assert run.max_batch >= 3  # requests really shared steps
    assert run.mixed_steps >= 2  # prefill chunks and decodes in the same forward


@pytest.mark.parametrize("budget", [1, 3, 7, 64])
def test_token_budgets_chunked_prefill(hf: HFOracle, budget: int) -> None:
    # Lengths chosen so the chunks end at many different offsets within blocks of 4.
    lengths = [9, 14, 6] if budget == 1 else [9, 14, 22, 6, 31]
    max_tokens = [5, 4, 6] if budget == 1 else [7, 5, 9, 12, 4]
    jobs = make_jobs(2, lengths, max_tokens)
    for i, j in enumerate(jobs):
        j.arrive_step = 3 * i
    cfg = SchedulerConfig(max_num_batched_tokens=budget, block_size=4, num_blocks=128)
    run = run_jobs(hf, jobs, cfg)
    assert_matches_hf(hf, run, jobs)
    if budget < 31:
        # Some prompt was split into several chunks.
        chunks = [
            n
            for s in run.engine.steps
            for n, p in zip(s.plan.num_new_tokens, s.plan.is_prefill, strict=True)
            if p
        ]
        assert any(n < max(lengths) for n in chunks)


def test_shared_system_prompt_prefix_cache(hf: HFOracle) -> None:
    g = torch.Generator().manual_seed(3)
    system = random_prompt(g, 26)  # 6 full blocks of 4 and a partial one
    jobs = [
        Job(f"s{i}", system + torch.randint(3, 320, (k,), generator=g).tolist(), m, arrive_step=at)
        for i, (k, m, at) in enumerate([(5, 8, 0), (3, 10, 6), (9, 6, 7), (1, 12, 12)])
    ]
    run = run_jobs(
        hf, jobs, SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=128)
    )
    assert_matches_hf(hf, run, jobs)
    assert run.engine.num_prefix_hit_tokens >= 3 * 24
    for j in jobs[1:]:
        assert run.finals[(j.rid, 0)].metrics.num_cached_tokens >= 24


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_small_pool_forces_recompute_preemptions(hf: HFOracle, prefix_caching: bool) -> None:
    jobs = make_jobs(4, [10, 13, 7, 16, 9], [20, 18, 24, 14, 22])
    for i, j in enumerate(jobs):
        j.arrive_step = i
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        block_size=4,
        num_blocks=16,
        enable_prefix_caching=prefix_caching,
    )
    run = run_jobs(hf, jobs, cfg)
    assert_matches_hf(hf, run, jobs)
    assert run.engine.num_preemptions >= 3
    assert sum(run.finals[(j.rid, 0)].metrics.num_preemptions for j in jobs) >= 3


def test_aborting_neighbours_mid_flight(hf: HFOracle) -> None:
    jobs = make_jobs(5, [12, 30, 8, 19, 25, 6], [16, 12, 20, 10, 14, 18])
    for i, j in enumerate(jobs):
        j.arrive_step = i
    jobs[1].abort_step = 2  # mid-prefill (30 tokens at a budget of 8)
    jobs[2].abort_step = 8  # decoding
    jobs[5].abort_step = 5  # just arrived: waiting or first chunk
    cfg = SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=64)
    run = run_jobs(hf, jobs, cfg)
    assert_matches_hf(hf, run, jobs)
    for j in (jobs[1], jobs[2], jobs[5]):
        assert run.finals[(j.rid, 0)].finish_reason == "abort"


@pytest.mark.parametrize("max_num_seqs", [256, 2])
def test_n_greater_than_one_forks_share_the_prompt(hf: HFOracle, max_num_seqs: int) -> None:
    jobs = make_jobs(6, [13, 8, 21], [10, 12, 9])
    jobs[0].n = 3
    jobs[2].n = 2
    jobs[2].arrive_step = 3
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, block_size=4, num_blocks=128, max_num_seqs=max_num_seqs
    )
    run = run_jobs(hf, jobs, cfg)
    # Greedy: every sample equals the single greedy continuation, decoded on shared blocks
    # (or, past max_num_seqs, recomputed later from the prefix cache like a preempted one).
    assert_matches_hf(hf, run, jobs)
    assert run.max_batch <= max_num_seqs
    if max_num_seqs > 3:
        assert run.engine.num_forks == 3
        assert any(s.plan.copies for s in run.engine.steps)  # copy-on-write really happened
    else:
        # Some samples waited (no room to run) and recomputed from the prefix cache.
        assert run.engine.num_prefix_hit_tokens > 0


def test_logits_match_transformers_per_step(hf: HFOracle) -> None:
    jobs = make_jobs(7, [7, 18, 4, 27], [9, 6, 12, 5])
    for i, j in enumerate(jobs):
        j.arrive_step = 2 * i
    cfg = SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=128)
    run = run_jobs(hf, jobs, cfg, record_logits=True)
    worst = 0.0
    for j in jobs:
        out = run.finals[(j.rid, 0)]
        full = j.prompt + list(out.token_ids)
        ref = hf.logits(full)[len(j.prompt) - 1 : len(full) - 1]
        mine = torch.stack(run.logits[j.rid])
        assert mine.shape == ref.shape
        torch.testing.assert_close(mine, ref, atol=ATOL, rtol=RTOL)
        worst = max(worst, float((mine - ref).abs().max()))
    assert worst < ATOL


def test_logprobs_are_those_of_the_model(hf: HFOracle) -> None:
    g = torch.Generator().manual_seed(8)
    prompt = random_prompt(g, 11)
    engine = LLMEngine(str(hf.path), check_invariants=True)
    (res,) = engine.generate([prompt], SamplingParams(max_tokens=6, logprobs=True))
    out = res.outputs[0]
    full = prompt + list(out.token_ids)
    ref = torch.log_softmax(hf.logits(full)[len(prompt) - 1 : len(full) - 1], dim=-1)
    want = [float(ref[i, t]) for i, t in enumerate(out.token_ids)]
    assert out.logprobs is not None
    assert out.logprobs == pytest.approx(want, abs=1e-4)


def _by_index(outs: Mapping[tuple[str, int], RequestOutput], rid: str) -> list[tuple[int, ...]]:
    return [o.token_ids for (r, _), o in sorted(outs.items()) if r == rid]
