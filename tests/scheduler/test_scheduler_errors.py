"""Bad input to the scheduler, its config, traces and the CLI: a clear typed error, and
nothing changes.

For the scheduler every rejection is made against a *running* workload (requests
waiting, mid-prefill and decoding). The test asserts that ``Scheduler.snapshot()``, the
waiting and running order, the step index and the live set are exactly as before, and
that the workload then runs to the same outcome (every token, every finish reason) as an
identical run that never saw the bad call, with every step checked by
``EngineCore(check_invariants=True)``. Trace errors name ``<source>:<line>``; the CLI
turns every refserve error into exit status 2 and ``refserve: error: ...`` on stderr.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from refserve.cli.main import main
from refserve.core.config import Admission, PolicyName, SchedulerConfig
from refserve.core.cost import StepCost
from refserve.core.engine_core import EngineCore
from refserve.core.executor_output import BadExecutorOutput
from refserve.core.request import Request, StopParams
from refserve.core.scheduler import Scheduler, StepInProgress
from refserve.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidArgument,
    RefserveError,
    UnknownRequest,
)
from refserve.sim.simulator import SimExecutor
from refserve.sim.trace import TraceError, load_trace, parse_trace
from refserve.spec.snapshot import RequestStatus as S

CONFIG = SchedulerConfig(
    max_num_batched_tokens=6,
    max_num_seqs=3,
    block_size=2,
    num_blocks=12,
    max_model_len=32,
)
WARMUP_STEPS = 2


def _workload() -> list[Request]:
    return [
        Request("w0", [1, 2, 3], StopParams(max_tokens=5)),
        Request("w1", [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], StopParams(max_tokens=3)),
        Request("w2", [4, 4], StopParams(max_tokens=4)),
        Request("w3", [7] * 5, StopParams(max_tokens=2)),
        Request("w4", [1, 2, 3, 9], StopParams(max_tokens=3)),
    ]


class Engine:
    """A scheduler with a workload in flight, stepped through the checked engine core."""

    def __init__(self, config: SchedulerConfig = CONFIG) -> None:
        self.sched = Scheduler(config)
        self.core = EngineCore(
            self.sched, SimExecutor(StepCost(), self.sched.requests), check_invariants=True
        )
        self.all = _workload()
        for r in self.all:
            self.sched.add_request(r)
        for _ in range(WARMUP_STEPS):
            self.core.step(0.0)

    def state(self) -> tuple[object, ...]:
        s = self.sched
        return (
            s.snapshot(),
            [r.request_id for r in s.waiting],
            [r.request_id for r in s.running],
            s.step_index,
            sorted(s.requests),
        )

    def drain(self) -> dict[str, tuple[list[int], str | None]]:
        for _ in range(200):
            if not self.sched.has_unfinished:
                break
            self.core.step(0.0)
        assert not self.sched.has_unfinished
        return {r.request_id: (list(r.token_ids), r.finish_reason) for r in self.all}


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[list[int], str | None]]:
    return Engine().drain()


@pytest.fixture
def engine() -> Engine:
    e = Engine()
    statuses = {r.status for r in e.sched.requests.values()}
    # The rejections below hit a scheduler with work in every queue.
    assert {S.WAITING, S.PREFILLING, S.DECODING} <= statuses, statuses
    return e


def _unchanged_then_same_outcome(
    engine: Engine, before: tuple[object, ...], reference: dict[str, object]
) -> None:
    assert engine.state() == before
    assert engine.drain() == reference


# ---------------------------------------------------------------- add_request
def _long(cfg: SchedulerConfig) -> Request:
    return Request("x", [1] * cfg.max_model_len)


BAD_REQUESTS: dict[str, tuple[Callable[[], Request], type[Exception], str]] = {
    "duplicate id (live)": (lambda: Request("w0", [1]), DuplicateRequest, "'w0'"),
    "empty prompt": (lambda: Request("x", []), InvalidArgument, "'x' has an empty prompt"),
    "negative token id": (lambda: Request("x", [1, -1]), InvalidArgument, "bad token id -1"),
    "float token id": (lambda: Request("x", [1, 1.5]), InvalidArgument, "bad token id 1.5"),  # type: ignore[list-item]
    "str token id": (lambda: Request("x", ["7"]), InvalidArgument, "bad token id '7'"),  # type: ignore[list-item]
    "bool token id": (lambda: Request("x", [True]), InvalidArgument, "bad token id True"),
    "None token id": (lambda: Request("x", [None]), InvalidArgument, "bad token id None"),  # type: ignore[list-item]
    "prompt == max_model_len": (lambda: _long(CONFIG), InvalidArgument, "max_model_len is 32"),
    "prompt > max_model_len": (
        lambda: Request("x", [1] * 40),
        InvalidArgument,
        "'x' prompt has 40 tokens",
    ),
    "prompt > pool": (
        lambda: Request("x", [1] * 25),
        ExceedsCapacity,
        "'x' needs 13 KV blocks but the pool has only 12",
    ),
    "empty id": (lambda: Request("", [1]), InvalidArgument, "non-empty str"),
    "non-str id": (lambda: Request(7, [1]), InvalidArgument, "non-empty str"),  # type: ignore[arg-type]
    "not fresh (decoding)": (
        lambda: Request("x", [1], status=S.DECODING),
        InvalidArgument,
        "'x' is not fresh",
    ),
    "not fresh (computed)": (
        lambda: Request("x", [1, 2], num_computed_tokens=1),
        InvalidArgument,
        "'x' is not fresh",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_is_rejected_and_changes_nothing(
    case: str, engine: Engine, reference: dict[str, object]
) -> None:
    make, error, words = BAD_REQUESTS[case]
    before = engine.state()
    with pytest.raises(error) as info:
        engine.sched.add_request(make())
    assert isinstance(info.value, RefserveError)
    assert words in str(info.value)
    _unchanged_then_same_outcome(engine, before, reference)


def test_prompt_that_fits_exactly_is_accepted() -> None:
    """The boundaries of the rejections above are accepted: no off-by-one."""
    cfg = replace(CONFIG, num_blocks=12, max_model_len=25)
    sched = Scheduler(cfg)
    sched.add_request(Request("x", [1] * 24))  # 12 blocks, one token of room
    assert sched.waiting[0].request_id == "x"


def test_prompt_over_budget_without_chunked_prefill_is_rejected() -> None:
    """Without chunking a prompt must fit one step, or it is never scheduled (it was
    accepted and spun forever / broke PROGRESS). The budget also caps the length, so a
    preempted request's recompute of prompt + outputs always fits one step too."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=8, block_size=1, num_blocks=20, enable_chunked_prefill=False
    )
    assert cfg.max_len == 8
    sched = Scheduler(cfg)
    before = sched.snapshot()
    with pytest.raises(InvalidArgument, match=r"'x' prompt has 9 tokens.*token budget 8"):
        sched.add_request(Request("x", [1] * 9))
    assert sched.snapshot() == before and not sched.waiting
    sched.add_request(Request("ok", [1] * 7, StopParams(max_tokens=50)))
    core = EngineCore(sched, SimExecutor(StepCost(), sched.requests), check_invariants=True)
    while sched.has_unfinished:
        core.step(0.0)
    assert sched.retired[0].num_tokens == 8 and sched.retired[0].finish_reason == "length"


def test_preempted_recompute_fits_the_budget_without_chunked_prefill() -> None:
    """Minimal reproducer of the stall: B (older) keeps decoding, A (newer, 7-token
    prompt) grows past the budget of 8 and is preempted; its recompute needed 9+
    tokens in one step and was never scheduled again (PROGRESS violation)."""
    for num_blocks in range(9, 16):
        cfg = SchedulerConfig(
            max_num_batched_tokens=8,
            block_size=1,
            num_blocks=num_blocks,
            enable_chunked_prefill=False,
            enable_prefix_caching=False,
        )
        sched = Scheduler(cfg)
        core = EngineCore(sched, SimExecutor(StepCost(), sched.requests), check_invariants=True)
        sched.add_request(Request("B", [1], StopParams(max_tokens=20)))
        sched.add_request(Request("A", [2] * 7, StopParams(max_tokens=6)))
        for _ in range(100):
            if not sched.has_unfinished:
                break
            core.step(0.0)
        assert not sched.has_unfinished


def test_rejected_request_does_not_consume_an_arrival_number(engine: Engine) -> None:
    with pytest.raises(InvalidArgument):
        engine.sched.add_request(Request("x", []))
    late = Request("late", [3, 3])
    engine.sched.add_request(late)
    assert late.seq == len(engine.all)


def _refusal(sched: Scheduler, r: Request) -> str:
    with pytest.raises(RefserveError) as info:
        sched.add_request(r)
    return f"{type(info.value).__name__}: {info.value}"


@pytest.mark.mutation_kill
def test_add_request_refusals_are_exact_and_count_only_capacity_and_queue() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        max_num_seqs=2,
        block_size=4,
        num_blocks=4,
        max_model_len=20,
        max_waiting=2,
    )
    sched = Scheduler(cfg)
    used = Request("x", [1, 2])
    used.token_ids.append(3)  # a sampled token: not fresh
    assert _refusal(sched, used) == (
        "InvalidArgument: add_request: request 'x' is not fresh (status waiting)"
    )
    assert _refusal(sched, Request("", [1])) == (
        "InvalidArgument: add_request: request id must be a non-empty str, got ''"
    )
    assert _refusal(sched, Request("x", [])) == (
        "InvalidArgument: add_request: request 'x' has an empty prompt"
    )
    assert _refusal(sched, Request("x", [0, -2])) == (
        "InvalidArgument: add_request: request 'x' has a bad token id -2"
    )
    assert _refusal(sched, Request("x", [1] * 20)) == (
        "InvalidArgument: add_request: request 'x' prompt has 20 tokens; max_model_len is 20, "
        "leaving no room for an output token"
    )
    assert sched.num_rejected == 0  # malformed input is not an admission-control rejection
    assert _refusal(sched, Request("x", [1] * 17)) == (
        "ExceedsCapacity: request 'x' needs 5 KV blocks but the pool has only 4"
    )
    assert sched.num_rejected == 1
    sched.add_request(Request("a", [1] * 16))  # 4 blocks of 4: exactly the pool
    sched.add_request(Request("b", [0]))
    assert _refusal(sched, Request("c", [1])) == (
        "QueueFull: add_request: request 'c' rejected: 2 requests already wait"
    )
    assert sched.num_rejected == 2
    assert _refusal(sched, Request("a", [1])) == (
        "DuplicateRequest: add_request: request id 'a' is already in use"
    )
    assert _refusal(sched, Request("y", [1] * 19)).startswith("ExceedsCapacity: request 'y'")
    assert sched.num_rejected == 3
    sched.schedule(0.0)
    assert _refusal(sched, Request("z", [1])) == (
        "StepInProgress: add_request: a step is in progress (schedule without commit/rollback)"
    )
    sched.rollback()
    assert [r.request_id for r in sched.waiting] == ["a", "b"]
    assert [r.seq for r in sched.waiting] == [0, 1]


@pytest.mark.mutation_kill
def test_without_chunked_prefill_the_budget_caps_the_prompt_by_name() -> None:
    cfg = SchedulerConfig(
        max_num_batched_tokens=8, block_size=4, num_blocks=8, enable_chunked_prefill=False
    )
    sched = Scheduler(cfg)
    assert _refusal(sched, Request("x", [1] * 8)) == (
        "InvalidArgument: add_request: request 'x' prompt has 8 tokens; without chunked "
        "prefill the token budget 8 caps the length, leaving no room for an output token"
    )
    sched.add_request(Request("y", [1] * 7))
    assert sched.waiting[0].request_id == "y"


# -------------------------------------------------------------------- abort
def test_abort_unknown_id(engine: Engine, reference: dict[str, object]) -> None:
    before = engine.state()
    with pytest.raises(UnknownRequest, match="abort: unknown request id 'nope'"):
        engine.sched.abort("nope")
    _unchanged_then_same_outcome(engine, before, reference)


def test_abort_twice(engine: Engine) -> None:
    victim = next(r for r in engine.sched.running if r.status is S.DECODING)
    engine.sched.abort(victim.request_id)
    before = engine.state()
    with pytest.raises(UnknownRequest, match=repr(victim.request_id)):
        engine.sched.abort(victim.request_id)
    assert engine.state() == before
    out = engine.drain()
    assert out[victim.request_id][1] == "abort"


def test_abort_of_a_finished_request_is_unknown(engine: Engine) -> None:
    engine.drain()
    with pytest.raises(UnknownRequest):
        engine.sched.abort("w0")


# ------------------------------------------------------------ step protocol
def test_schedule_twice_without_commit(engine: Engine, reference: dict[str, object]) -> None:
    before = engine.state()
    plan = engine.sched.schedule()
    pending = engine.sched.snapshot()
    with pytest.raises(StepInProgress, match="schedule"):
        engine.sched.schedule()
    assert engine.sched.snapshot() == pending  # the second call touched nothing
    assert engine.sched._pending is plan
    engine.sched.rollback()
    _unchanged_then_same_outcome(engine, before, reference)


def test_add_and_abort_during_a_pending_step(engine: Engine, reference: dict[str, object]) -> None:
    before = engine.state()
    engine.sched.schedule()
    pending = engine.sched.snapshot()
    with pytest.raises(StepInProgress, match="add_request"):
        engine.sched.add_request(Request("x", [1]))
    with pytest.raises(StepInProgress, match="abort"):
        engine.sched.abort("w0")
    assert engine.sched.snapshot() == pending
    assert "x" not in engine.sched.requests and "w0" in engine.sched.requests
    engine.sched.rollback()
    _unchanged_then_same_outcome(engine, before, reference)


@pytest.mark.parametrize(
    "bad",
    [
        "missing",
        -1,
        True,
        1.0,
        "7",
        None,
    ],
    ids=repr,
)
def test_commit_with_bad_sampled_token(
    bad: object, engine: Engine, reference: dict[str, object]
) -> None:
    before = engine.state()
    plan = engine.sched.schedule()
    sampling = [c.request_id for c in plan.chunks if c.samples]
    assert sampling, "the warmed-up engine has a decode in every step"
    sampled: dict[str, object] = dict.fromkeys(sampling, 5)
    if bad == "missing":
        del sampled[sampling[0]]
    else:
        sampled[sampling[0]] = bad
    with pytest.raises(BadExecutorOutput, match=repr(sampling[0])):
        engine.sched.commit(plan, sampled)  # type: ignore[arg-type]
    engine.sched.rollback()
    _unchanged_then_same_outcome(engine, before, reference)


def test_executor_output_missing_a_token_rolls_back_in_engine_core(
    engine: Engine, reference: dict[str, object]
) -> None:
    """EngineCore validates the executor's output before commit and rolls back."""

    class Forgetful(SimExecutor):
        def execute(self, plan, inputs):  # type: ignore[no-untyped-def]
            out = super().execute(plan, inputs)
            return type(out)({}, out.duration_ms)

    before = engine.state()
    good = engine.core.executor
    engine.core.executor = Forgetful(StepCost(), engine.sched.requests)
    with pytest.raises(BadExecutorOutput):
        engine.core.step(0.0)
    engine.core.executor = good
    _unchanged_then_same_outcome(engine, before, reference)


# -------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be a positive int, got 0"),
        ({"max_num_batched_tokens": -8}, "max_num_batched_tokens must be a positive int, got -8"),
        ({"max_num_batched_tokens": True}, "max_num_batched_tokens must be a positive int"),
        ({"max_num_batched_tokens": 8.0}, "max_num_batched_tokens must be a positive int"),
        ({"max_num_batched_tokens": "8"}, "max_num_batched_tokens must be a positive int"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive int"),
        ({"block_size": 0}, "block_size must be a positive int"),
        ({"num_blocks": 0}, "num_blocks must be a positive int"),
        ({"max_model_len": False}, "max_model_len must be a positive int"),
        ({"num_blocks": 4, "watermark_blocks": 4}, "watermark_blocks (4) must be below num_blocks"),
        ({"num_blocks": 4, "watermark_blocks": 9}, "watermark_blocks (9) must be below num_blocks"),
        ({"watermark_blocks": -1}, "watermark_blocks must be a non-negative int"),
        ({"max_num_batched_tokens": 8, "prefill_reserve_tokens": 8}, "prefill_reserve_tokens"),
        ({"prefill_reserve_after_steps": -1}, "prefill_reserve_after_steps"),
        ({"admission": "bogus"}, "admission must be one of first_chunk, prompt, sequence"),
        ({"policy": "fifo"}, "policy must be one of decode-first, static"),
        (
            {"max_num_batched_tokens": 3, "block_size": 4, "align_chunks_to_blocks": True},
            "align_chunks_to_blocks needs max_num_batched_tokens (3) >= block_size (4)",
        ),
    ],
    ids=lambda x: str(x) if isinstance(x, dict) else "",
)
def test_bad_config(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
    assert words in str(info.value)


def test_config_strings_select_the_named_behaviour() -> None:
    """Plain strings are stored as enum members; "static" used to run decode-first and
    "first_chunk" used to admit like "sequence" (the scheduler compares with ``is``)."""
    cfg = SchedulerConfig(admission="first_chunk", policy="static")  # type: ignore[arg-type]
    assert cfg.admission is Admission.FIRST_CHUNK and cfg.policy is PolicyName.STATIC
    assert type(Scheduler(cfg).policy).__name__ == "Static"


@pytest.mark.parametrize("max_tokens", [0, -1, True, 1.5, "3", None], ids=repr)
def test_bad_stop_params(max_tokens: object) -> None:
    with pytest.raises(InvalidArgument, match="max_tokens must be"):
        StopParams(max_tokens=max_tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text", ["", "   ", "2+", "+", "abc", "2+0.5Q", "2++D", "-1+P", "2*P*D", "P+", "1e3", "0.5PD"]
)
def test_cost_model_parse_garbage(text: str) -> None:
    with pytest.raises(InvalidArgument, match="cost model"):
        StepCost.parse(text)


def test_cost_model_parse_good_and_negative_coefficient() -> None:
    assert StepCost.parse(" 2 + 0.5 P + D ") == StepCost(2, 0.5, 1, 0)
    assert StepCost.parse("K+3+P") == StepCost(3, 1, 0, 1)
    with pytest.raises(InvalidArgument, match="coefficient a must be >= 0"):
        StepCost(a=-1)


# --------------------------------------------------------------------- traces
GOOD = '{"id": "a", "arrival_ms": 0, "prompt_len": 4, "output_len": 2}'


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('{"id": "b", "prompt_len": 4, "output_len": 2, "colour": 1}', "unknown field(s) colour"),
        ('{"id": "b", "prompt_len": -4, "output_len": 2}', "'prompt_len' must be an int >= 1"),
        (
            '{"id": "b", "prompt_len": 0, "output_len": 2}',
            "'prompt_len' must be an int >= 1, got 0",
        ),
        ('{"id": "b", "prompt_len": 4, "output_len": 0}', "'output_len' must be an int >= 1"),
        ('{"id": "b", "prompt_len": 4, "output_len": -2}', "'output_len' must be an int >= 1"),
        ('{"id": "b", "prompt_len": 4}', "'output_len' must be an int >= 1, got None"),
        ('{"id": "b", "prompt_len": 2.5, "output_len": 2}', "'prompt_len' must be an int >= 1"),
        ('{"id": "b", "prompt_len": true, "output_len": 2}', "'prompt_len' must be an int >= 1"),
        ('{"id": "b", "arrival_ms": -1, "prompt_len": 4, "output_len": 2}', "'arrival_ms' must"),
        ('{"id": "b", "arrival_ms": "5", "prompt_len": 4, "output_len": 2}', "'arrival_ms' must"),
        ('{"id": "a", "arrival_ms": 1, "prompt_len": 4, "output_len": 2}', "duplicate request id"),
        ('{"id": "b", "output_len": 2}', "give exactly one of 'prompt_len' or 'prompt_token_ids'"),
        (
            '{"id": "b", "prompt_len": 2, "prompt_token_ids": [1, 2], "output_len": 2}',
            "give exactly one of",
        ),
        ('{"id": "b", "prompt_token_ids": [], "output_len": 2}', "must be a non-empty list"),
        ('{"id": "b", "prompt_token_ids": [1, -2], "output_len": 2}', "bad token id -2"),
        ('{"id": "b", "prompt_token_ids": [1, "x"], "output_len": 2}', "bad token id 'x'"),
        ('{"id": "b", "prompt_len": 4, "output_len": 2', "not valid JSON"),
        ("not json at all", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"prompt_len": 4, "output_len": 2}', "'id' must be a non-empty string"),
        ('{"id": 5, "prompt_len": 4, "output_len": 2}', "'id' must be a non-empty string"),
        ('{"id": "b", "prompt_len": 4, "output_len": 2, "priority": "hi"}', "'priority' must"),
        ('{"id": "b", "prompt_len": 4, "output_len": 2, "tenant": 3}', "'tenant' must"),
        ('{"id": "b", "prompt_len": 4, "output_len": 2, "prefix_group": 1}', "'prefix_group'"),
        (
            '{"id": "b", "prompt_len": 4, "output_len": 2, "prefix_group": "g", "prefix_len": 9}',
            "'prefix_len' must be an int in 0..4",
        ),
    ],
)
def test_trace_errors_name_the_line(line: str, words: str) -> None:
    # Line 2 is blank: line numbers still count it, so the bad line is line 3.
    last = GOOD.replace('"a"', '"z"')
    text = f"{GOOD}\n\n{line}\n{last}\n"
    with pytest.raises(TraceError) as info:
        parse_trace(text, "t.jsonl")
    msg = str(info.value)
    assert msg.startswith("t.jsonl:3: "), msg
    assert words in msg, msg


def test_trace_arrival_out_of_order_names_the_line() -> None:
    text = "\n".join(
        [
            '{"id": "a", "arrival_ms": 5, "prompt_len": 4, "output_len": 2}',
            '{"id": "b", "arrival_ms": 7, "prompt_len": 4, "output_len": 2}',
            '{"id": "c", "arrival_ms": 6, "prompt_len": 4, "output_len": 2}',
        ]
    )
    with pytest.raises(TraceError, match=r"^t\.jsonl:3: arrival_ms 6 is before .* 7"):
        parse_trace(text, "t.jsonl")


def test_trace_equal_arrivals_and_defaults_are_fine() -> None:
    text = GOOD + "\n" + GOOD.replace('"a"', '"b"')
    out = parse_trace(text, "t.jsonl")
    assert [t.id for t in out] == ["a", "b"] and out[0].arrival_ms == out[1].arrival_ms == 0


def test_load_trace_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "absent.jsonl")


# ------------------------------------------------------------------------ CLI
def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_cli_bad_trace_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(GOOD + "\n" + '{"id": "b", "prompt_len": -3, "output_len": 2}\n')
    code, err = _cli(capsys, "simulate", str(trace))
    assert code == 2
    assert err.startswith("refserve: error: ")
    assert f"{trace}:2: 'prompt_len' must be an int >= 1, got -3" in err


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('{"id": "b", "prompt_len": 3, "output_len": 2, "colour": "red"}', "unknown field(s)"),
        ('{"id": "a", "prompt_len": 3, "output_len": 2}', "duplicate request id 'a'"),
        ('{"id": "b", "arrival_ms": -5, "prompt_len": 3, "output_len": 2}', "'arrival_ms'"),
        ("{oops", "not valid JSON"),
    ],
)
def test_cli_trace_errors(
    line: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD.replace('"arrival_ms": 0', '"arrival_ms": 1') + "\n" + line + "\n")
    code, err = _cli(capsys, "simulate", str(trace), "--quiet")
    assert code == 2
    assert err.startswith(f"refserve: error: {trace}:2: ")
    assert words in err


def test_cli_out_of_order_arrival(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"id": "a", "arrival_ms": 9, "prompt_len": 3, "output_len": 2}\n'
        '{"id": "b", "arrival_ms": 1, "prompt_len": 3, "output_len": 2}\n'
    )
    code, err = _cli(capsys, "simulate", str(trace))
    assert code == 2 and err.startswith(f"refserve: error: {trace}:2: arrival_ms 1 is before")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be a positive int, got 0"),
        (["--max-num-batched-tokens", "-4"], "max_num_batched_tokens must be a positive int"),
        (["--max-num-seqs", "0"], "max_num_seqs must be a positive int"),
        (["--block-size", "0"], "block_size must be a positive int"),
        (["--num-blocks", "4", "--watermark-blocks", "4"], "watermark_blocks (4) must be below"),
        (["--cost", "2+0.5Q"], "cost model '2+0.5Q': cannot read term '0.5Q'"),
        (["--max-model-len", "4"], "request 'A' prompt has 6 tokens; max_model_len is 4"),
        (["--num-blocks", "1", "--block-size", "2"], "request 'A' needs 3 KV blocks"),
    ],
)
def test_cli_bad_options(args: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _cli(capsys, "simulate", "seed002", *args)
    assert code == 2
    assert err.startswith("refserve: error: ")
    assert words in err
    assert "Traceback" not in err


def test_cli_good_run_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "seed002", "--max-num-batched-tokens", "4", "--check"]) == 0
    assert "makespan 19.50 ms" in capsys.readouterr().out
