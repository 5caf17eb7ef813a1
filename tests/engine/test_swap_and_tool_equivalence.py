"""Swap preemption and agent tool pauses on the real model, token for token against
transformers' greedy ``generate``.

Every engine here runs with ``check_invariants=True`` (the spec, host pool included,
checked after every step). The swap copies are audited as they happen: after a
swap-out the host blocks must hold exactly the device blocks' K/V, after a swap-in the
device blocks exactly the host blocks'; and a swap-in whose destination blocks already
held that K/V would prove nothing, so the scenarios require destinations that held
something else (blocks reused by other requests meanwhile, or never written). Without
the copies those requests would attend to another request's K/V and the comparison
with transformers would fail.

Tool turns: a request generates ``k`` tokens, pauses (its KV kept on the device, moved
to the host, or dropped), other requests run meanwhile, and it resumes with the tool's
tokens; the new turn must equal ``generate`` on prompt + first-turn outputs + tool
tokens, run alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hf_oracle import VOCAB, HFOracle, random_prompt

from refserve.core.config import SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.swap import KVRetention, SwapCost
from refserve.engine.llm_engine import InvalidPrompt, LLMEngine, RequestOutput
from refserve.errors import InvalidArgument, UnknownRequest
from refserve.kv import BlockCopy
from refserve.model.llama import HostKVCache, KVCache
from refserve.model.sampler import InvalidSamplingParams, SamplingParams
from refserve.spec.snapshot import RequestStatus

# The logits tolerance of test_engine_equivalence.py (its docstring has the figures).
ATOL = 2e-5
RTOL = 1e-5


@dataclass
class SwapAudit:
    """Checks every swap copy as the executor applies it (see the module doc)."""

    out_blocks: int = 0
    in_blocks: int = 0
    # Swap-in copies whose destination held other K/V than the host block before it.
    in_needed: int = 0
    in_needless: int = 0


def _same_block(
    a: KVCache | HostKVCache, a_block: int, b: KVCache | HostKVCache, b_block: int
) -> bool:
    return all(
        torch.equal(x[a_block].cpu(), y[b_block].cpu())
        for xs, ys in ((a.key, b.key), (a.value, b.value))
        for x, y in zip(xs, ys, strict=True)
    )


def audit_swaps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> SwapAudit:
    audit = SwapAudit()
    host = engine.host_cache
    swap_out, swap_in = host.swap_out, host.swap_in

    def checked_out(cache: KVCache, copies: Sequence[BlockCopy]) -> int:
        moved = swap_out(cache, copies)
        for c in copies:
            assert _same_block(cache, c.src, host, c.dst), f"swap-out {c} did not copy"
        audit.out_blocks += len(copies)
        return moved

    def checked_in(cache: KVCache, copies: Sequence[BlockCopy]) -> int:
        held = [_same_block(host, c.src, cache, c.dst) for c in copies]
        moved = swap_in(cache, copies)
        for c in copies:
            assert _same_block(host, c.src, cache, c.dst), f"swap-in {c} did not copy"
        audit.in_blocks += len(copies)
        audit.in_needless += sum(held)
        audit.in_needed += len(held) - sum(held)
        return moved

    monkeypatch.setattr(host, "swap_out", checked_out)
    monkeypatch.setattr(host, "swap_in", checked_in)
    return audit


def record_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    logits: dict[str, list[torch.Tensor]] = {}

    def hook(rids: tuple[str, ...], rows: torch.Tensor) -> None:
        for i, rid in enumerate(rids):
            logits.setdefault(rid, []).append(rows[i].clone())

    engine.executor.logits_hook = hook
    return logits


def assert_logits_match(
    hf: HFOracle, prompt: Sequence[int], outputs: Sequence[int], mine: Sequence[torch.Tensor]
) -> None:
    full = [*prompt, *outputs]
    ref = hf.logits(full)[len(prompt) - 1 : len(full) - 1]
    got = torch.stack(list(mine))
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def assert_swap_bytes_counted(engine: LLMEngine, audit: SwapAudit) -> None:
    """Bytes counted = blocks in the committed plans x (K + V of a block, all layers)."""
    per_block = engine.cache.bytes_per_block
    cfg = engine.model_config
    assert per_block == 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32
    planned_out = sum(len(s.plan.swap_out) for s in engine.steps)
    planned_in = sum(len(s.plan.swap_in) for s in engine.steps)
    assert (audit.out_blocks, audit.in_blocks) == (planned_out, planned_in)
    assert engine.swap_out_bytes == planned_out * per_block > 0
    assert engine.swap_in_bytes == planned_in * per_block > 0
    sched = engine.scheduler
    assert (sched.num_swapped_out_blocks, sched.num_swapped_in_blocks) == (planned_out, planned_in)


def assert_pools_empty(engine: LLMEngine) -> None:
    pool, host = engine.scheduler.pool, engine.scheduler.host
    assert pool.num_free_blocks == pool.num_blocks
    assert host.num_free_blocks == host.num_blocks


def step_all(engine: LLMEngine, *, limit: int = 2000) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for o in engine.iter_outputs():
        outs.append(o)
        assert len(engine.steps) < limit, "engine did not finish"
    return outs


def _status(engine: LLMEngine, rid: str) -> RequestStatus:
    return engine.scheduler.requests[rid].status


def _runnable(engine: LLMEngine) -> bool:
    return engine.has_runnable


def finals(outs: Sequence[RequestOutput]) -> dict[str, RequestOutput]:
    return {o.request_id: o for o in outs if o.finished}


# ---------------------------------------------------------------- preemption by swap
SWAP_JOBS = ([10, 13, 7, 16, 9], [20, 18, 24, 14, 22])  # prompt lengths, max_tokens


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_matches_transformers(
    hf: HFOracle, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 16 blocks of 4 tokens for five requests of up to 40 tokens: several preemptions.
    # "auto" with 3 ms per copy direction and 0.5 ms per recomputed token: swap wins
    # from 12 stored tokens on, so the run mixes both kinds of preemption.
    cost = SwapCost(kv_bytes_per_token=768, latency_ms=3.0, iteration=StepCost(b=0.5))
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        block_size=4,
        num_blocks=16,
        preemption_mode=mode,  # type: ignore[arg-type]  # the str form is accepted
        num_host_blocks=64,
        swap_cost=cost if mode == "auto" else None,
    )
    engine = LLMEngine(str(hf.path), scheduler_config=cfg, check_invariants=True)
    audit = audit_swaps(engine, monkeypatch)
    logits = record_logits(engine)
    g = torch.Generator().manual_seed(4)
    jobs = [
        (f"r{i}", random_prompt(g, n), m) for i, (n, m) in enumerate(zip(*SWAP_JOBS, strict=True))
    ]
    outs: list[RequestOutput] = []
    for rid, prompt, m in jobs:  # one arrival per step
        engine.add_request(prompt, SamplingParams(max_tokens=m), request_id=rid)
        outs.extend(engine.step())
    outs.extend(step_all(engine))
    done = finals(outs)
    for rid, prompt, m in jobs:
        want = hf.greedy(prompt, m)
        assert done[rid].token_ids == want, f"{rid}: {done[rid].token_ids} != HF {want}"
        assert_logits_match(hf, prompt, want, logits[rid])

    preempted = [rid for s in engine.steps for rid in s.plan.preempted]
    swapped = [rid for s in engine.steps for rid in s.plan.swapped_out]
    swapped_in = [rid for s in engine.steps for rid in s.plan.swapped_in]
    assert len(swapped) >= 2 and sorted(swapped) == sorted(swapped_in)
    assert set(swapped) <= set(preempted)  # no pauses here: every swap-out is a victim
    if mode == "swap":
        assert swapped == preempted  # the host pool always had room
    else:
        assert len(swapped) < len(preempted)  # some victims were too short to swap
    assert sum(done[r].metrics.num_preemptions for r, _, _ in jobs) == len(preempted)
    assert_swap_bytes_counted(engine, audit)
    assert audit.in_needed >= audit.in_blocks // 2 > 0  # swap-ins that mattered
    assert_pools_empty(engine)


# ---------------------------------------------------------------- tool pauses
@dataclass
class ToolRun:
    engine: LLMEngine
    audit: SwapAudit
    logits: dict[str, list[torch.Tensor]]
    prompt: list[int]
    turn1: tuple[int, ...]
    tool: list[int]
    outs: list[RequestOutput] = field(default_factory=list)
    blocks_before_pause: tuple[int, ...] = ()
    reused_by_others: bool = False
    first_resumed_start: int | None = None


def run_tool_turn(
    hf: HFOracle,
    cfg: SchedulerConfig,
    retention: KVRetention,
    monkeypatch: pytest.MonkeyPatch,
    *,
    k: int = 6,
    others: Sequence[tuple[int, int]] = ((9, 16), (17, 12)),
    late: Sequence[tuple[int, int]] = (),
    paused_steps: int = 4,
    seed: int = 11,
) -> ToolRun:
    """Agent ``a`` decodes ``k`` tokens, pauses with ``retention`` while ``others`` (prompt
    length, max_tokens) and then ``late`` (added right after the pause) run for
    ``paused_steps`` steps, then resumes with 5 tool tokens for an 8-token turn;
    everything then runs to completion."""
    engine = LLMEngine(str(hf.path), scheduler_config=cfg, check_invariants=True)
    audit = audit_swaps(engine, monkeypatch)
    logits = record_logits(engine)
    g = torch.Generator().manual_seed(seed)
    prompt = random_prompt(g, 14)
    tool = torch.randint(3, VOCAB, (5,), generator=g).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=40), request_id="a")
    outs: list[RequestOutput] = []
    for i, (n, m) in enumerate(others):
        engine.add_request(random_prompt(g, n), SamplingParams(max_tokens=m), request_id=f"o{i}")
    turn1: list[int] = []
    while len(turn1) < k:
        for o in engine.step():
            outs.append(o)
            if o.request_id == "a":
                turn1.extend(o.new_token_ids)
        assert len(engine.steps) < 200
    sched = engine.scheduler
    assert _status(engine, "a") is RequestStatus.DECODING
    run = ToolRun(engine, audit, logits, prompt, tuple(turn1), tool)
    run.blocks_before_pause = tuple(sched.pool.block_table_view("a"))
    assert engine.pause("a", retention) is retention
    assert engine.paused_request_ids == ("a",)
    jobs = [(f"o{i}", n, m) for i, (n, m) in enumerate(others)]
    for i, (n, m) in enumerate(late):
        jobs.append((f"l{i}", n, m))
        engine.add_request(random_prompt(g, n), SamplingParams(max_tokens=m), request_id=f"l{i}")
    step_outs = engine.step()
    outs.extend(o for o in step_outs if o.request_id != "a")
    (marker,) = [o for o in step_outs if o.request_id == "a"]
    # The pause's own output: no new tokens, the whole first turn, not finished.
    assert marker.new_token_ids == () and marker.token_ids == run.turn1
    assert not marker.finished and marker.turn == 0
    for _ in range(paused_steps - 1):
        step_outs = engine.step()
        assert all(o.request_id != "a" for o in step_outs), "a paused request produced output"
        outs.extend(step_outs)
        held: set[int] = set()
        for r in sched.running:
            held.update(sched.pool.block_table_view(r.request_id))
        run.reused_by_others |= bool(held & set(run.blocks_before_pause))
    assert _status(engine, "a") is RequestStatus.WAITING_TOOL
    steps_before_resume, outs_before_resume = len(engine.steps), len(outs)
    engine.resume("a", tool, SamplingParams(max_tokens=8))
    outs.extend(step_all(engine))
    run.outs = outs
    for s in engine.steps[steps_before_resume:]:
        if "a" in s.plan.request_ids:
            run.first_resumed_start = s.plan.starts[s.plan.request_ids.index("a")]
            break
    # Every other request is exactly transformers' greedy continuation.
    g = torch.Generator().manual_seed(seed)
    random_prompt(g, 14)
    torch.randint(3, VOCAB, (5,), generator=g)
    done = finals(outs)
    for rid, n, m in jobs:
        assert done[rid].token_ids == hf.greedy(random_prompt(g, n), m), rid
    # Turn 1 is the greedy continuation of the prompt; turn 2 that of the conversation.
    assert run.turn1 == hf.greedy(prompt, k)
    conversation = [*prompt, *run.turn1, *tool]
    final = done["a"]
    want = hf.greedy(conversation, 8)
    assert final.turn == 1 and final.token_ids == want, f"turn 2: {final.token_ids} != HF {want}"
    turn2 = [o for o in outs[outs_before_resume:] if o.request_id == "a"]
    assert [o.turn for o in turn2] == [1] * len(want)
    assert tuple(t for o in turn2 for t in o.new_token_ids) == want
    assert final.metrics.num_prompt_tokens == len(conversation)
    assert final.metrics.num_output_tokens == len(want)
    assert len(final.metrics.token_times_ms) == len(want)
    assert_logits_match(hf, conversation, want, logits["a"][k:])
    assert_pools_empty(engine)
    return run


def _tool_cfg(**kw: Any) -> SchedulerConfig:
    base: dict[str, Any] = dict(
        max_num_batched_tokens=16, block_size=4, num_blocks=24, num_host_blocks=32
    )
    base.update(kw)
    return SchedulerConfig(**base)


@pytest.mark.parametrize("retention", list(KVRetention))
def test_tool_pause_resume_matches_transformers(
    hf: HFOracle, retention: KVRetention, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = run_tool_turn(hf, _tool_cfg(), retention, monkeypatch)
    steps = run.engine.steps
    stored = len(run.prompt) + len(run.turn1) - 1  # KV of every token but the last sampled
    swapped_out = [rid for s in steps for rid in s.plan.swapped_out]
    swapped_in = [rid for s in steps for rid in s.plan.swapped_in]
    if retention is KVRetention.HOST:
        assert swapped_out == ["a"] and swapped_in == ["a"]
        assert_swap_bytes_counted(run.engine, run.audit)
        assert run.audit.in_blocks == -(-stored // 4)
    else:
        assert not swapped_out and not swapped_in
        assert run.engine.swap_out_bytes == run.engine.swap_in_bytes == 0
    if retention is KVRetention.DROP:
        # Recomputed: from the start or from a prefix-cache hit on a block boundary.
        assert run.first_resumed_start is not None and run.first_resumed_start % 4 == 0
        assert run.first_resumed_start < stored
    else:
        # The KV waited (on the device or the host): only the new tokens are computed.
        assert run.first_resumed_start == stored


def test_host_retention_under_pressure_matches_transformers(
    hf: HFOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 14 blocks: while the agent waits on the host, a 30-token arrival takes its old
    # device blocks; later the pool is so tight that the agent's swap-in preempts (by
    # swap) the request holding them, in the same step.
    cfg = _tool_cfg(num_blocks=14, preemption_mode="swap")
    run = run_tool_turn(
        hf,
        cfg,
        KVRetention.HOST,
        monkeypatch,
        others=((13, 14),),
        late=((30, 12), (9, 10)),
        paused_steps=6,
    )
    assert run.reused_by_others, "the paused turn's device blocks were not reused"
    assert_swap_bytes_counted(run.engine, run.audit)
    (a_in,) = [s.plan for s in run.engine.steps if "a" in s.plan.swapped_in]
    # The agent's swap-in restored K/V into blocks that held something else ...
    assert run.audit.in_needed >= len(a_in.swap_in) > 0
    # ... some of them read by a swap-out of the same step: only the executor's order
    # (every swap-out before any swap-in) keeps the victim's K/V.
    assert {c.src for c in a_in.swap_out} & {c.dst for c in a_in.swap_in}
    victims = [rid for s in run.engine.steps for rid in s.plan.swapped_out if rid != "a"]
    assert victims


# ---------------------------------------------------------------- engine API details
def _tiny(**kw: Any) -> LLMEngine:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, block_size=4, num_blocks=64, max_model_len=128, **kw
    )
    return LLMEngine("tiny", scheduler_config=cfg, check_invariants=True)


def _decode(engine: LLMEngine, rid: str, k: int) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while sum(len(o.new_token_ids) for o in outs if o.request_id == rid) < k:
        outs.extend(engine.step())
    return outs


def test_swap_out_in_a_step_that_schedules_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _tiny(num_host_blocks=8)
    audit = audit_swaps(engine, monkeypatch)
    prompt = [256, 72, 105, 33, 40]
    engine.add_request(prompt, SamplingParams(max_tokens=20), request_id="a")
    turn1 = [t for o in _decode(engine, "a", 3) for t in o.new_token_ids]
    engine.pause("a", "host")
    # Only a paused request: has_unfinished, but nothing to run; iter_outputs returns.
    assert engine.has_unfinished and _runnable(engine)  # the pause output is held
    (marker,) = engine.step()
    rec = engine.steps[-1]
    assert rec.plan.request_ids == () and rec.plan.swapped_out == ("a",)
    assert audit.out_blocks == len(rec.plan.swap_out) == 2  # 7 stored tokens, blocks of 4
    assert engine.swap_out_bytes == 2 * engine.cache.bytes_per_block
    assert engine.scheduler.pool.num_used_blocks == 0
    assert engine.has_unfinished and not _runnable(engine)
    assert list(engine.iter_outputs()) == []
    assert marker.token_ids == tuple(turn1) and marker.text == engine.tokenizer.decode(turn1)
    engine.resume("a", "tool says hi", {"max_tokens": 4})
    outs = list(engine.iter_outputs())
    assert outs[-1].finished and outs[-1].turn == 1 and len(outs[-1].token_ids) == 4
    # Swapped back into blocks that did not hold its K/V (the freed ones wait at the back
    # of the free queue), so the restored K/V came from the host copy.
    assert audit.in_blocks == 2 and audit.in_needed == 2
    conv = [*prompt, *turn1, *engine.tokenizer.encode("tool says hi", add_special_tokens=False)]
    (ref,) = _tiny().generate([conv], SamplingParams(max_tokens=4))
    assert outs[-1].token_ids == ref.outputs[0].token_ids
    assert_pools_empty(engine)


def test_stream_ends_at_a_pause_and_abort_frees_a_paused_request() -> None:
    engine = _tiny(num_host_blocks=8)
    got: list[RequestOutput] = []
    for o in engine.stream([256, 10, 20], SamplingParams(max_tokens=30), request_id="s"):
        got.append(o)
        if len(got) == 2:
            engine.pause("s", KVRetention.HOST)
    assert [len(o.new_token_ids) for o in got] == [1, 1, 0]  # the last is the pause output
    engine.step()  # moves its KV to the host
    assert engine.scheduler.host.num_used_blocks == 1
    engine.abort("s")
    (final,) = engine.step()
    assert final.finished and final.finish_reason == "abort" and len(final.token_ids) == 2
    assert not engine.has_unfinished
    assert_pools_empty(engine)


BAD: list[tuple[str, Callable[[LLMEngine], object], type[Exception]]] = [
    ("pause unknown", lambda e: e.pause("nope"), UnknownRequest),
    ("pause finished", lambda e: e.pause("done"), UnknownRequest),
    ("pause n=2", lambda e: e.pause("pair"), InvalidArgument),
    ("pause prefilling", lambda e: e.pause("long"), InvalidArgument),
    ("pause twice", lambda e: e.pause("tool"), InvalidArgument),
    ("pause bad retention", lambda e: e.pause("keep", "disk"), InvalidArgument),
    ("pause bad wait", lambda e: e.pause("keep", expected_wait_ms=-1.0), InvalidArgument),
    ("resume unknown", lambda e: e.resume("nope", [5]), UnknownRequest),
    ("resume running", lambda e: e.resume("keep", [5]), InvalidArgument),
    ("resume empty str", lambda e: e.resume("tool", ""), InvalidPrompt),
    ("resume empty ids", lambda e: e.resume("tool", []), InvalidPrompt),
    ("resume bad id", lambda e: e.resume("tool", [5, 999]), InvalidPrompt),
    ("resume bytes", lambda e: e.resume("tool", b"x"), InvalidPrompt),
    ("resume too long", lambda e: e.resume("tool", [5] * 120), InvalidPrompt),
    ("resume n=2", lambda e: e.resume("tool", [5], {"n": 2}), InvalidSamplingParams),
    ("resume bad params", lambda e: e.resume("tool", [5], {"top_p": 0}), InvalidSamplingParams),
]


def test_bad_pause_and_resume_are_typed_errors_and_change_nothing() -> None:
    (ref,) = _tiny().generate(["keep going"], SamplingParams(max_tokens=40))
    engine = _tiny()  # no host pool: "host" retention is bad input too
    engine.add_request("keep going", SamplingParams(max_tokens=40), request_id="keep")
    engine.add_request([256, 1], SamplingParams(max_tokens=1), request_id="done")
    engine.add_request("tool user", SamplingParams(max_tokens=30), request_id="tool")
    engine.add_request("a pair", SamplingParams(max_tokens=30, n=2), request_id="pair")
    outs = engine.step() + engine.step()
    engine.add_request([256] * 100, SamplingParams(max_tokens=2), request_id="long")
    outs += engine.step()
    assert engine.pause("tool", "device") is KVRetention.DEVICE
    with pytest.raises(InvalidArgument, match="num_host_blocks"):
        engine.pause("keep", "host")
    for name, call, exc in BAD:
        before = engine.scheduler.snapshot()
        groups = set(engine.books.request_ids)
        with pytest.raises(exc):
            call(engine)
        assert engine.scheduler.snapshot() == before, name
        assert set(engine.books.request_ids) == groups, name
        assert engine.paused_request_ids == ("tool",), name
        outs.extend(engine.step())
    engine.abort("tool")
    outs.extend(engine.iter_outputs())
    done = finals(outs)
    assert done["keep"].token_ids == ref.outputs[0].token_ids
    assert done["tool"].finish_reason == "abort"
    assert {"done", "pair", "long"} <= set(done)


def test_swap_cost_must_describe_this_model() -> None:
    """The engine refuses a swap cost model priced for another model's KV size."""
    wrong = SwapCost(kv_bytes_per_token=524_288)
    cfg = SchedulerConfig(
        num_blocks=16, block_size=4, preemption_mode="auto", num_host_blocks=8, swap_cost=wrong
    )
    with pytest.raises(InvalidArgument, match=r"this model.s K and V take 512 bytes per token"):
        LLMEngine("tiny", scheduler_config=cfg)
