"""A request migrated between engines any number of times, at drawn step boundaries,
produces exactly what it produces unmigrated (the
protocol of ref/engine/migration.py, docs/MIGRATION.md).

Greedy, on the transformers oracle's checkpoint (``hf``, tests/engine/hf_oracle.py): the
tokens are ``generate(do_sample=False)``'s, for a request moved between three engines
with block sizes 4, 8 and 16, different pool sizes and token budgets (chunked prefill:
the prompt takes several steps, and moves land mid-prefill), by transfer (inline, and
streamed in chunks of 1 and 2 blocks) and by recompute, with neighbours on every engine
whose prompts share the request's prefix (so the destination's own prefix hits are used:
only the missing K/V travels). Seeded and sampled, on the tiny model: the tokens, text
and stream of deltas are the unmigrated run's, for ``n > 1`` moved before and after its
fork, a swapped request, a request paused for a tool, stop strings whose first
characters are held back at the move, with logprobs carried. Metrics on one injected
clock: a transfer keeps arrival, first-token and token times exactly; a recompute keeps
every time before the move and delays the later ones by exactly the extra prefill steps.

Every move is checked on the spot (tests/engine/migration_helpers.py, ``move``): the
source holds nothing of the request, both pools pass spec's pool checks, and every K/V
slot the destination received reads back the source's bytes for that position. Every
engine runs ``check_invariants`` (every spec invariant after every step).

The planted bugs of item 5(c) at the end are each caught by one of these checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import pytest
import torch
from hf_oracle import HFOracle, random_prompt
from migration_helpers import (
    HOWS,
    INLINE,
    RECOMPUTE,
    STREAM1,
    STREAM2,
    Clock,
    How,
    Trace,
    assert_delivered_once,
    drive,
    fixed_step_ms,
    make_engine,
    move,
    one_torch_thread,
    random_plan,
    step_all,
    stream_view,
)

from refserve.core.swap import KVRetention
from refserve.core.transit import Import, KVPlace
from refserve.engine import migration
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.engine.ticket import KVChunk, MigrationTicket, SeqTicket, TicketError
from refserve.model.sampler import SamplingParams, mix64
from refserve.spec.snapshot import RequestStatus

S = RequestStatus


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


PLANS: list[tuple[str, Sequence[How]]] = [(str(h), (h,)) for h in HOWS] + [("mixed", HOWS)]


def _assert_moves_cover(trace: Trace, prompt_len: int) -> None:
    """The drawn moves include one mid-prefill (some of the prompt's KV computed, not
    all) and one while decoding."""
    mid = [m for m in trace.moves if m.status is S.PREFILLING and 0 < m.kv_length < prompt_len]
    decoding = [m for m in trace.moves if m.num_output_tokens > 0]
    assert mid, f"no move mid-prefill in {[(m.status, m.kv_length) for m in trace.moves]}"
    assert decoding, "no move while decoding"


# ---------------------------------------------------------------- greedy: transformers
def _hf_engines(hf: HFOracle) -> list[LLMEngine]:
    path = str(hf.path)
    return [
        make_engine(path, block_size=4, num_blocks=48, budget=5),
        make_engine(path, block_size=8, num_blocks=24, budget=7),
        make_engine(path, block_size=16, num_blocks=12, budget=3),
    ]


@pytest.mark.parametrize(("name", "hows"), PLANS, ids=[p[0] for p in PLANS])
def test_greedy_migrated_matches_transformers(hf: HFOracle, name: str, hows: Sequence[How]) -> None:
    trace, prompt, neighbours = _greedy_run(hf, hows, seed=sum(map(ord, name)))
    (final,) = trace.finals("r").values()
    want = hf.greedy(prompt, 10)
    assert final.token_ids == want, f"{final.token_ids} != HF {want}"
    assert final.finish_reason == ("stop" if want[-1] == hf.config.eos_token_id else "length")
    assert_delivered_once(trace.of("r"))
    for rid, p, m in neighbours:
        assert trace.finals(rid)[0].token_ids == hf.greedy(p, m), rid
    assert len(trace.moves) >= 3
    _assert_moves_cover(trace, len(prompt))
    if any(h.kv == "transfer" for h in hows):
        # The destination's own cached prefix was used: only the rest travelled.
        assert any(m.report.decision.hit_tokens > 0 for m in trace.moves if m.how.kv != "recompute")
    assert final.metrics.migrations == tuple(m.report.decision for m in trace.moves)


def _greedy_run(
    hf: HFOracle, hows: Sequence[How], *, seed: int
) -> tuple[Trace, list[int], list[tuple[str, list[int], int]]]:
    """``r`` (21 tokens, 10 out) starts on engine 0 and moves round robin at drawn
    boundaries (tick 1 always: mid-prefill); each engine runs a neighbour, those on
    engines 1 and 2 sharing ``r``'s first 17 tokens."""
    engines = _hf_engines(hf)
    g = torch.Generator().manual_seed(31)
    prompt = random_prompt(g, 21)
    neighbours = [
        ("n0", random_prompt(g, 9), 6),
        ("n1", prompt[:17] + random_prompt(g, 4)[1:], 5),
        ("n2", prompt[:17] + random_prompt(g, 3)[1:], 4),
    ]
    engines[0].add_request(prompt, SamplingParams(max_tokens=10), request_id="r")
    for e, (rid, p, m) in zip(engines, neighbours, strict=True):
        e.add_request(p, SamplingParams(max_tokens=m), request_id=rid)
    trace = drive(engines, "r", random_plan(seed, hows, p=0.45, always=(1,)))
    for e in engines:
        pool = e.scheduler.pool
        assert pool.num_free_blocks == pool.num_blocks, "a block leaked"
    assert sum(e.num_migrations_in for e in engines) == len(trace.moves)
    assert sum(e.num_migrations_out for e in engines) == len(trace.moves)
    return trace, prompt, neighbours


# ---------------------------------------------------------------- sampled: itself
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, logprobs=True)
PROMPT = "Move me, then continue: "


def _tiny_engines(n: int = 3) -> list[LLMEngine]:
    configs = [(4, 64, 5), (8, 40, 7), (16, 16, 3)]
    return [
        make_engine(block_size=bs, num_blocks=nb, budget=budget) for bs, nb, budget in configs[:n]
    ]


def _alone(params: SamplingParams, prompt: str = PROMPT, rid: str = "r") -> list[RequestOutput]:
    """The unmigrated run: on an engine configured like engine 0 of ``_tiny_engines``."""
    (e,) = _tiny_engines(1)
    e.add_request(prompt, params, request_id=rid)
    return drive([e], rid, lambda k: None).of(rid)


def _migrated(
    params: SamplingParams,
    hows: Sequence[How],
    *,
    seed: int,
    p: float = 0.5,
    always: Sequence[int] = (1,),
    prompt: str = PROMPT,
    num_engines: int = 3,
) -> Trace:
    engines = _tiny_engines(num_engines)
    engines[0].add_request(prompt, params, request_id="r")
    return drive(engines, "r", random_plan(seed, hows, p=p, always=always))


def check_sampled(hows: Sequence[How], seed: int) -> Trace:
    """Seeded sampling, migrated: the unmigrated tokens, text and deltas; logprobs
    carried bit for bit up to the first move, within rounding after it."""
    ref = _alone(SAMPLED)
    trace = _migrated(SAMPLED, hows, seed=seed)
    mine = trace.of("r")
    view = [(o.new_text, o.new_token_ids, o.text, o.token_ids, o.finish_reason) for o in mine]
    want = [(o.new_text, o.new_token_ids, o.text, o.token_ids, o.finish_reason) for o in ref]
    assert view == want, "the migrated stream differs from the unmigrated one"
    assert_delivered_once(mine)
    got_lp, want_lp = mine[-1].logprobs, ref[-1].logprobs
    assert got_lp is not None and want_lp is not None
    # Up to the first move engine 0 ran exactly like the unmigrated engine.
    k = trace.moves[0].num_output_tokens
    assert got_lp[:k] == want_lp[:k]
    assert trace.moves[0].ticket.sequences[0].logprobs == want_lp[:k]
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-5, rtol=0)
    return trace


@pytest.mark.parametrize(("name", "hows"), PLANS, ids=[p[0] for p in PLANS])
def test_seeded_sampling_migrated_equals_unmigrated(name: str, hows: Sequence[How]) -> None:
    trace = check_sampled(hows, seed=sum(map(ord, name)) + 1)
    assert len(trace.moves) >= 3
    _assert_moves_cover(trace, len(PROMPT) + 1)


def test_n_greater_than_one_moved_before_and_after_its_fork() -> None:
    params = SamplingParams(n=3, max_tokens=8, temperature=0.9, seed=77)
    ref = _alone(params, "forked samples")
    for hows, seed in (((INLINE,), 3), ((STREAM1, RECOMPUTE), 4)):
        trace = _migrated(params, hows, seed=seed, p=0.3, always=(1, 5), prompt="forked samples")
        mine = trace.of("r")
        for i in range(3):
            want = [(o.new_text, o.new_token_ids, o.finish_reason) for o in ref if o.index == i]
            got = [(o.new_text, o.new_token_ids, o.finish_reason) for o in mine if o.index == i]
            assert got == want, f"sample {i} ({hows})"
        assert_delivered_once(mine, num_samples=3)
        before = [m for m in trace.moves if not m.ticket.forked]
        after = [m for m in trace.moves if m.ticket.forked and len(m.ticket.sequences) == 3]
        assert before and all(len(m.ticket.sequences) == 1 for m in before)
        assert before[0].ticket.child_ids == ("r#1", "r#2")
        assert after, "no move of the three forked samples together"


# ---------------------------------------------------------------- swapped, paused
@pytest.mark.parametrize("how", [INLINE, STREAM1, RECOMPUTE], ids=str)
def test_swapped_request_migrated_matches_transformers(hf: HFOracle, how: How) -> None:
    # 10 blocks of 4 for three requests of up to 37 tokens: the swap test's squeeze.
    src = make_engine(
        str(hf.path),
        block_size=4,
        num_blocks=10,
        budget=16,
        preemption_mode="swap",
        num_host_blocks=64,
    )
    dst = make_engine(str(hf.path), block_size=8, num_blocks=24, budget=7)
    g = torch.Generator().manual_seed(4)
    jobs = [
        (f"s{i}", random_prompt(g, n), m) for i, (n, m) in enumerate([(10, 20), (13, 18), (7, 24)])
    ]
    trace = Trace()
    swapped: str | None = None
    for rid, p, m in jobs:
        src.add_request(p, SamplingParams(max_tokens=m), request_id=rid)
        step_all([src], trace)
    for _ in range(60):
        swapped = next(
            (r.request_id for r in src.scheduler.requests.values() if r.status is S.SWAPPED), None
        )
        if swapped is not None:
            break
        step_all([src], trace)
    assert swapped is not None, "no request was swapped out"
    moved = move(src, dst, swapped, how)
    assert moved.status is S.SWAPPED and moved.ticket.sequences[0].kv_place is KVPlace.HOST
    assert moved.kv_length > 0
    drive([src, dst], swapped, lambda k: None, trace=trace)
    for rid, p, m in jobs:
        assert trace.finals(rid)[0].token_ids == hf.greedy(p, m), rid
    assert trace.finals(swapped)[0].metrics.num_preemptions >= 1


def _tool_run(retention: KVRetention, how: How | None) -> Trace:
    """``a`` samples 4 tokens, pauses for a tool (``retention``), is moved (``how``;
    None: not moved), resumes with the tool's answer and is moved again mid-turn."""
    engines = [
        make_engine(block_size=4, num_blocks=64, budget=5, num_host_blocks=32),
        make_engine(block_size=8, num_blocks=40, budget=7, num_host_blocks=16),
    ]
    engines = engines[:1] if how is None else engines
    src = engines[0]
    trace = Trace()
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=5)
    src.add_request("agent: ", params, request_id="a")
    while len([t for o in trace.of("a") for t in o.new_token_ids]) < 4:
        step_all(engines, trace)
    assert src.pause("a", retention) is retention
    step_all(engines, trace)  # the pause's output; a host retention's KV moves now
    owner = src
    if how is not None:
        m = move(src, engines[1], "a", how)
        assert m.status is S.WAITING_TOOL
        place = {"device": KVPlace.DEVICE, "host": KVPlace.HOST, "drop": KVPlace.NONE}
        assert m.ticket.sequences[0].kv_place is place[retention.value]
        trace.moves.append(m)
        owner = engines[1]
        trace.owner = 1
    owner.resume("a", " tool says 42", SamplingParams(max_tokens=6, temperature=0.8, seed=9))
    plan = (lambda k: None) if how is None else (lambda k: how if k == 1 else None)
    return drive(engines, "a", plan, trace=trace)


@pytest.mark.parametrize("how", [INLINE, STREAM1, RECOMPUTE], ids=str)
@pytest.mark.parametrize("retention", list(KVRetention), ids=lambda r: r.value)
def test_paused_request_migrated_then_resumed(retention: KVRetention, how: How) -> None:
    ref = _tool_run(retention, None).of("a")
    trace = _tool_run(retention, how)
    assert stream_view(trace.of("a")) == stream_view(ref)
    assert [o.turn for o in ref][-1] == 1 and ref[-1].finished
    assert len(trace.moves) == 2 and trace.moves[1].ticket.turn == 1


# ---------------------------------------------------------------- stop strings
def _stop_strings() -> tuple[str, str, str]:
    """From the free greedy text: a stop string that ends the output (its first
    character's first occurrence at ``j`` >= 3, so it is held back there) and one that
    starts the same way but never completes."""
    (free,) = _alone(SamplingParams(max_tokens=24), "stop here: ")[-1:]
    text = free.text
    j = next(
        i
        for i in range(3, len(text) - 2)
        if "\ufffd" not in text[i : i + 2] and text[i] not in text[:i]
    )
    return text, text[j : j + 2], text[j : j + 2] + "\u2603\u2603"


def check_stop_string(
    stop: str, seed: int, include: bool = False
) -> tuple[list[RequestOutput], Trace]:
    """Moved at every boundary: the deltas, the final text and reason are the
    unmigrated run's, each token delivered once."""
    params = SamplingParams(max_tokens=24, stop=(stop,), include_stop_str_in_output=include)
    ref = _alone(params, "stop here: ")
    trace = _migrated(params, HOWS, seed=seed, p=1.0, prompt="stop here: ")
    mine = trace.of("r")
    assert stream_view(mine) == stream_view(ref), "the migrated stream differs"
    assert_delivered_once(mine)
    # The point of the test: some move came while a proper prefix of the stop string
    # was held back (text the source had not delivered, which the destination must).
    held = [s.text[s.delivered_chars :] for m in trace.moves for s in m.ticket.sequences]
    prefixes = [stop[:k] for k in range(1, len(stop))]
    assert any(h.endswith(p) for h in held for p in prefixes), "no stop-string prefix held back"
    return ref, trace


def test_stop_string_held_back_at_the_move() -> None:
    text, hit, miss = _stop_strings()
    ref, _ = check_stop_string(hit, seed=1)
    assert ref[-1].finish_reason == "stop" and ref[-1].stop_reason == hit
    assert ref[-1].text == text[: text.index(hit)]
    ref, _ = check_stop_string(miss, seed=2)
    assert ref[-1].finish_reason == "length" and ref[-1].text == text


def test_a_stop_string_kept_in_the_output_stays_kept_across_the_move() -> None:
    """``include_stop_str_in_output`` travels with the stream it shapes."""
    text, hit, _ = _stop_strings()
    ref, _ = check_stop_string(hit, seed=3, include=True)
    assert ref[-1].text == text[: text.index(hit) + len(hit)]


# ---------------------------------------------------------------- metrics
def _clocked(
    hows_at: dict[int, How], *, offsets: Sequence[float] = (0.0, 0.0), budget: int = 5
) -> tuple[Trace, list[LLMEngine]]:
    """``r`` on engine 0 moved at the ticks of ``hows_at``; each engine on its own fake
    clock (``offsets`` apart), every step 1 ms, the clocks moving 1 ms a tick."""
    clocks = [Clock(o) for o in offsets]
    configs = [(4, 64), (8, 40)]
    engines = [
        make_engine(
            block_size=bs, num_blocks=nb, budget=budget, clock=c, enable_prefix_caching=False
        )
        for (bs, nb), c in zip(configs, clocks, strict=False)
    ]
    for e in engines:
        fixed_step_ms(e, 1.0)
    engines[0].add_request(PROMPT, SAMPLED, request_id="r")

    def tick() -> None:
        for c in clocks:
            c.t += 1.0

    return drive(engines, "r", lambda k: hows_at.get(k), tick=tick), engines


def test_transfer_keeps_arrival_first_token_and_token_times() -> None:
    ref = _clocked({}, offsets=(0.0,))[0].finals("r")[0].metrics
    moves = {1: INLINE, 3: STREAM1, 8: STREAM2, 11: INLINE, 12: STREAM1}
    trace, _ = _clocked(moves)
    m = trace.finals("r")[0].metrics
    assert len(trace.moves) == 5
    assert m.arrival_ms == ref.arrival_ms and m.admitted_ms == ref.admitted_ms
    assert m.token_times_ms == ref.token_times_ms
    assert m.ttft_ms == ref.ttft_ms and m.itl_ms == ref.itl_ms


def test_times_move_onto_the_destination_clock() -> None:
    """Engines 1000 ms apart: the final times are on the last owner's clock and TTFT and
    every ITL are the unmigrated run's."""
    ref = _clocked({}, offsets=(0.0,))[0].finals("r")[0].metrics
    trace, _ = _clocked({2: INLINE, 9: STREAM1, 11: INLINE}, offsets=(0.0, 1000.0))
    m = trace.finals("r")[0].metrics
    assert trace.owner == 1
    assert m.arrival_ms == ref.arrival_ms + 1000.0
    assert m.token_times_ms == tuple(t + 1000.0 for t in ref.token_times_ms)
    assert m.ttft_ms == ref.ttft_ms and m.itl_ms == ref.itl_ms


def test_recompute_delays_later_tokens_by_its_prefill_steps() -> None:
    """A recompute cannot keep the times: the destination computes the KV again. What
    holds: arrival and every time before the move are kept, and each later token comes
    exactly ``ceil(T / b) - ceil((T - c) / b)`` steps later per move (T tokens, KV
    length c at the move, budget b: the steps the destination needs to reach the next
    sample, less those the source needed)."""
    budget = 5
    ref = _clocked({}, offsets=(0.0,), budget=budget)[0].finals("r")[0].metrics
    trace, _ = _clocked({2: RECOMPUTE, 9: RECOMPUTE}, budget=budget)
    m = trace.finals("r")[0].metrics
    assert m.arrival_ms == ref.arrival_ms
    want = list(ref.token_times_ms)
    for mv in trace.moves:
        s = mv.ticket.sequences[0].state
        total, c = len(s.token_ids), s.num_computed_tokens
        delay = math.ceil(total / budget) - math.ceil((total - c) / budget)
        assert delay > 0
        for i in range(mv.num_output_tokens, len(want)):
            want[i] += delay
    assert m.token_times_ms == tuple(want)
    k = trace.moves[0].num_output_tokens
    assert m.token_times_ms[:k] == ref.token_times_ms[:k]


def test_resumed_turn_keeps_its_ttft_across_clocks() -> None:
    """A turn resumed after a tool, moved to an engine whose clock is 1000 ms ahead:
    the turn's arrival moves onto that clock with its token times (TTFT kept)."""

    def run(move_it: bool) -> RequestOutput:
        clocks = [Clock(0.0), Clock(1000.0)]
        engines = [
            make_engine(block_size=4, clock=clocks[0]),
            make_engine(block_size=8, clock=clocks[1]),
        ]
        for e in engines:
            fixed_step_ms(e, 1.0)
        trace = Trace()

        def advance() -> None:
            for c in clocks:
                c.t += 1.0

        def tick() -> None:
            step_all(engines, trace)
            advance()

        engines[0].add_request("agent: ", SamplingParams(max_tokens=20, seed=1), request_id="a")
        for _ in range(10):
            tick()
        engines[0].pause("a", KVRetention.DEVICE)
        tick()
        engines[0].resume("a", " ok", SamplingParams(max_tokens=4, seed=2))
        tick()
        if move_it:
            move(engines[0], engines[1], "a", INLINE)
        drive(engines, "a", lambda k: None, trace=trace, tick=advance)
        return trace.finals("a")[0]

    ref, moved = run(False).metrics, run(True).metrics
    assert moved.ttft_ms == ref.ttft_ms and moved.itl_ms == ref.itl_ms
    assert moved.arrival_ms == ref.arrival_ms + 1000.0


# ---------------------------------------------------------------- planted bugs (5(c))
def test_planted_rng_not_carried_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed replaced on import: the sampled check sees other tokens."""
    real = migration.stage

    def reseeded(engine: LLMEngine, ticket: MigrationTicket, **kw: float) -> migration.StagedImport:
        return real(engine, replace(ticket, seed=mix64(ticket.seed, 1)), **kw)

    monkeypatch.setattr(migration, "stage", reseeded)
    with pytest.raises(AssertionError, match="differs from the unmigrated"):
        check_sampled((INLINE,), seed=5)
    monkeypatch.undo()
    check_sampled((INLINE,), seed=5)


def _delivered_all(st: SeqTicket) -> SeqTicket:
    return replace(st, delivered_chars=len(st.text))


def _text_cut(st: SeqTicket) -> SeqTicket:
    return replace(st, text=st.text[: st.delivered_chars])


STOP_PLANTS = [
    # The ticket claims the held-back text was delivered: the destination never sends it.
    ("delivered_chars", _delivered_all, AssertionError, "stream differs"),
    # The held-back text cut from the ticket: the import sees its tokens give more.
    ("text truncated", _text_cut, TicketError, "its tokens detokenize to"),
]


@pytest.mark.parametrize(
    ("name", "plant", "exc", "msg"), STOP_PLANTS, ids=[p[0] for p in STOP_PLANTS]
)
def test_planted_stop_string_suffix_dropped_is_caught(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    plant: Callable[[SeqTicket], SeqTicket],
    exc: type[Exception],
    msg: str,
) -> None:
    """A stop string's held-back prefix lost on export is caught: by the stream check,
    or by the import's own check of the ticket's text."""
    real = migration._seq_ticket

    def dropped(*args: object) -> SeqTicket:
        return plant(real(*args))  # type: ignore[arg-type]

    _, _, miss = _stop_strings()
    monkeypatch.setattr(migration, "_seq_ticket", dropped)
    with pytest.raises(exc, match=msg):
        check_stop_string(miss, seed=2)
    monkeypatch.undo()
    check_stop_string(miss, seed=2)


def test_planted_block_from_the_wrong_position_is_caught(
    hf: HFOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_kv`` one block off: the move's K/V check sees other bytes at once."""
    real = migration.read_kv

    def off_by_a_block(engine: LLMEngine, seq_id: str, start: int, end: int) -> KVChunk:
        bs = engine.scheduler.config.block_size
        if start < bs:
            return real(engine, seq_id, start, end)
        wrong = real(engine, seq_id, start - bs, end - bs)
        return KVChunk(seq_id, start, end, wrong.data)

    monkeypatch.setattr(migration, "read_kv", off_by_a_block)
    with pytest.raises(AssertionError, match=r"K/V of \[\d+, \d+\) differs"):
        _greedy_run(hf, (STREAM1,), seed=7)
    monkeypatch.undo()
    _greedy_run(hf, (STREAM1,), seed=7)


def test_planted_cached_block_counted_twice_is_caught(
    hf: HFOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The destination holds each prefix-hit block once more than its tables do: the
    move's pool check (BLOCK) fails."""
    real = Import.stage

    def twice(self: Import, state: object, *, with_kv: bool) -> object:
        arrival = real(self, state, with_kv=with_kv)  # type: ignore[arg-type]
        pool = self._sched.pool
        table = pool.block_table(arrival.state.request_id) if arrival.kv_length else ()
        for b in table[: arrival.num_hit_tokens // pool.block_size]:
            pool._blocks.hold(b)
        return arrival

    monkeypatch.setattr(Import, "stage", twice)
    with pytest.raises(AssertionError, match="destination pool after the move"):
        _greedy_run(hf, (INLINE,), seed=8)
    monkeypatch.undo()
    _greedy_run(hf, (INLINE,), seed=8)
