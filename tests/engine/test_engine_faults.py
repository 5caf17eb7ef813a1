"""Faults and hostile input: one request's fault never stalls or loses another's.

- Sampling options that cannot be sampled are rejected at ``add_request`` with a typed
  error naming the field; a row of logits that cannot be sampled ends that request alone
  with the finish reason ``error`` (ref/model/sampler.py module doc) while the step commits for
  everyone, so the healthy requests' tokens equal a run without the poisoned one.
- Outputs held for the next step survive an executor fault and are delivered once.
- Sample ids ``<id>#<i>`` are the engine's; every sample of an ``n > 1`` request gets a
  final output, also when it ends before its first token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from refserve.core.config import SchedulerConfig
from refserve.core.executor import StepOutput
from refserve.core.inputs import ModelInputs
from refserve.core.plan import StepPlan
from refserve.core.request import FinishReason
from refserve.engine.llm_engine import LLMEngine, RequestOutput
from refserve.errors import InvalidArgument
from refserve.model.executor import ExecutorError
from refserve.model.sampler import (
    FAILED_TOKEN,
    MIN_TEMPERATURE,
    InvalidSamplingParams,
    SampleSpec,
    SamplingParams,
    sample,
    sample_failed,
    sample_row,
)


def _engine(**kw: object) -> LLMEngine:
    cfg = kw.pop("scheduler_config", None) or SchedulerConfig(
        max_num_batched_tokens=16, block_size=4, num_blocks=64, max_model_len=128
    )
    return LLMEngine("tiny", scheduler_config=cfg, check_invariants=True, **kw)  # type: ignore[arg-type]


def _run(engine: LLMEngine) -> dict[tuple[str, int], RequestOutput]:
    """Step to the end; the final output of every sample, checking each comes once."""
    final: dict[tuple[str, int], RequestOutput] = {}
    for o in engine.iter_outputs():
        if o.finished:
            assert (o.request_id, o.index) not in final, "a final output came twice"
            final[(o.request_id, o.index)] = o
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not engine.has_unfinished
    return final


#: The healthy neighbours: greedy, seeded sampling with both filters, and an n = 2 fork.
HEALTHY: list[tuple[str, str, SamplingParams]] = [
    ("greedy", "The quick brown fox", SamplingParams(max_tokens=10)),
    (
        "sampled",
        "jumps over",
        SamplingParams(max_tokens=9, temperature=0.8, top_k=40, top_p=0.9, seed=3),
    ),
    ("pair", "the lazy dog", SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=5)),
]


def _add_healthy(engine: LLMEngine) -> None:
    for rid, prompt, sp in HEALTHY:
        engine.add_request(prompt, sp, request_id=rid)


def _poison_rows(engine: LLMEngine, victim: str, from_output: int) -> None:
    """Make the victim's logits row NaN once it has ``from_output`` sampled tokens.

    The model computes logits for every sampling row at once; the wrapper learns which
    row is whose from the step's inputs, exactly as the executor lays them out.
    """
    executor = engine.executor
    model = engine.model
    execute, logits_of = executor.execute, model.logits
    rows: list[str] = []

    def spy(plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        rows[:] = [] if inputs is None else list(inputs.sample_request_ids)
        return execute(plan, inputs)

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        out = logits_of(hidden)
        req = engine.scheduler.requests.get(victim)
        if victim in rows and req is not None and req.num_output_tokens >= from_output:
            out = out.clone()
            out[rows.index(victim)] = float("nan")
        return out

    executor.execute = spy  # type: ignore[method-assign]
    model.logits = poisoned  # type: ignore[method-assign]


def _reference() -> dict[tuple[str, int], RequestOutput]:
    engine = _engine()
    _add_healthy(engine)
    return _run(engine)


def _healthy_tokens(final: dict[tuple[str, int], RequestOutput]) -> dict[tuple[str, int], object]:
    return {k: (o.token_ids, o.finish_reason) for k, o in final.items() if k[0] != "victim"}


# ---------------------------------------------------------------- the sampler alone
def test_sample_isolates_a_non_finite_row() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    specs = [
        SampleSpec(),
        SampleSpec(temperature=1.0, seed=1, logprobs=True),
        SampleSpec(temperature=0.7, top_k=5, seed=2),
        SampleSpec(logprobs=True),
    ]
    clean = sample(logits, specs, [3] * 4)
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = logits.clone()
        poisoned[1, 7] = bad
        out = sample(poisoned, specs, [3] * 4)
        assert out[0] == clean[0] and out[2:] == clean[2:]
        assert out[1][0] == FAILED_TOKEN and sample_failed(out[1][1])
        assert sample_failed(sample_row(poisoned[1], specs[1], 3)[1])
    assert not any(sample_failed(lp) for _, lp in clean)
    # A temperature that slipped past validation overflows the scaled logits: failed, not
    # the "probability tensor contains inf/nan" RuntimeError of torch.multinomial.
    tiny = sample_row(logits[0], SampleSpec(temperature=1e-45, seed=1), 0)
    assert tiny[0] == FAILED_TOKEN and sample_failed(tiny[1])
    assert not sample_failed(None) and not sample_failed(-3.0)


# ---------------------------------------------------------------- validation
BAD_PARAMS: list[tuple[str, object]] = [
    ("temperature", 1e-45),
    ("temperature", MIN_TEMPERATURE / 2),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -1.0),
    ("top_p", math.nan),
    ("top_p", math.inf),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0 + 1e-9),
    ("top_k", -2),
    ("top_k", 1.5),
    ("n", 0),
    ("max_tokens", 0),
    ("seed", -1),
    ("stop_token_ids", [-1]),
]


@pytest.mark.parametrize(("name", "value"), BAD_PARAMS)
def test_unsamplable_params_are_rejected_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParams, match=name) as err:
        SamplingParams.from_dict({name: value})
    assert err.value.field == name
    assert isinstance(err.value, InvalidArgument)


def test_rejected_params_leave_running_requests_alone() -> None:
    (ref,) = _engine().generate(["keep going"], SamplingParams(max_tokens=20))
    engine = _engine()
    engine.add_request("keep going", SamplingParams(max_tokens=20), request_id="keep")
    outs = engine.step()
    # A SamplingParams altered after construction is checked again at add_request.
    altered = SamplingParams(temperature=1.0)
    object.__setattr__(altered, "temperature", 1e-45)
    calls: list[Callable[[], object]] = [
        lambda: engine.add_request("x", {"temperature": 1e-45}),
        lambda: engine.add_request("x", {"top_p": math.nan}),
        lambda: engine.add_request("x", altered),
    ]
    for call in calls:
        with pytest.raises(InvalidSamplingParams) as err:
            call()
        assert err.value.field == "temperature" or err.value.field == "top_p"
        assert set(engine.scheduler.requests) == {"keep"}
        outs.extend(engine.step())
    outs.extend(engine.iter_outputs())
    assert [o.token_ids for o in outs if o.finished] == [ref.outputs[0].token_ids]
    # The edges stay accepted: exactly 0 (greedy) and MIN_TEMPERATURE itself.
    SamplingParams(temperature=0.0)
    SamplingParams(temperature=MIN_TEMPERATURE, top_p=1.0, top_k=-1)


# ---------------------------------------------------------------- isolation at sampling
def test_non_finite_logits_end_only_that_request_with_error() -> None:
    ref = _reference()
    (alone,) = _engine().generate(["poisoned later"], SamplingParams(max_tokens=12))
    engine = _engine()
    _add_healthy(engine)
    engine.add_request("poisoned later", SamplingParams(max_tokens=12), request_id="victim")
    _poison_rows(engine, "victim", from_output=3)
    final = _run(engine)  # no step raises
    assert _healthy_tokens(final) == _healthy_tokens(ref)
    victim = final[("victim", 0)]
    assert victim.finish_reason == FinishReason.ERROR.value == "error"
    assert victim.stop_reason is None
    # The three tokens sampled before the fault are kept; the placeholder is never shown.
    assert victim.token_ids == alone.outputs[0].token_ids[:3]
    assert victim.metrics.num_output_tokens == 3 and len(victim.metrics.token_times_ms) == 3
    assert victim.metrics.finish_reason == "error"


def test_non_finite_first_logits_end_every_sample_of_an_n_request() -> None:
    ref = _reference()
    engine = _engine()
    _add_healthy(engine)
    engine.add_request(
        "poisoned at once",
        SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=9),
        request_id="victim",
    )
    _poison_rows(engine, "victim", from_output=0)
    final = _run(engine)
    assert _healthy_tokens(final) == _healthy_tokens(ref)
    for i in range(3):
        out = final[("victim", i)]
        assert (out.finish_reason, out.token_ids, out.text) == ("error", (), "")
    assert engine.num_forks == 1  # only the healthy pair forked


def test_a_temperature_that_slips_past_validation_fails_alone() -> None:
    """The reported symptom: every step raised torch's 'probability tensor contains inf'."""
    ref = _reference()
    engine = _engine()
    _add_healthy(engine)
    rid = engine.add_request(
        "crafted", SamplingParams(max_tokens=5, temperature=1.0, seed=1), request_id="victim"
    )
    # Bypass SamplingParams entirely: the executor's spec is what the sampler reads.
    engine.executor.register(rid, SampleSpec(temperature=1e-45, seed=1))
    final = _run(engine)
    assert _healthy_tokens(final) == _healthy_tokens(ref)
    assert final[(rid, 0)].finish_reason == "error" and final[(rid, 0)].token_ids == ()


def test_error_wins_over_the_length_its_placeholder_reached() -> None:
    engine = _engine()
    engine.add_request("one token", SamplingParams(max_tokens=1), request_id="victim")
    _poison_rows(engine, "victim", from_output=0)
    final = _run(engine)
    assert final[("victim", 0)].finish_reason == "error"
    assert final[("victim", 0)].token_ids == ()


# ---------------------------------------------------------------- held outputs on a fault
def _fail_next_execute(engine: LLMEngine, times: int = 1) -> None:
    execute = engine.executor.execute
    left = [times]

    def flaky(plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        if left[0]:
            left[0] -= 1
            raise RuntimeError("injected executor fault")
        return execute(plan, inputs)

    engine.executor.execute = flaky  # type: ignore[method-assign]


def test_held_outputs_survive_a_failed_step_and_come_once() -> None:
    (ref,) = _engine().generate(["bystander"], SamplingParams(max_tokens=12))
    engine = _engine()
    engine.add_request("to abort", SamplingParams(max_tokens=30), request_id="a")
    engine.add_request("bystander", SamplingParams(max_tokens=12), request_id="b")
    engine.add_request("tool user", SamplingParams(max_tokens=30), request_id="t")
    seen: list[RequestOutput] = []
    for _ in range(4):
        seen.extend(engine.step())
    engine.abort("a")
    engine.pause("t", "device")
    _fail_next_execute(engine, times=2)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
    assert engine.has_unfinished  # the held outputs still count
    after = engine.step()
    held = [o for o in after if o.request_id in ("a", "t")]
    assert [(o.request_id, o.finished, o.finish_reason) for o in held] == [
        ("a", True, "abort"),
        ("t", False, None),
    ]
    seen.extend(after)
    seen.extend(engine.iter_outputs())
    assert [o.request_id for o in seen if o.request_id == "a" and o.finished] == ["a"]
    assert sum(1 for o in seen if o.request_id == "t" and not o.new_token_ids) == 1
    finals = [o for o in seen if o.request_id == "b" and o.finished]
    assert [o.token_ids for o in finals] == [ref.outputs[0].token_ids]
    engine.abort("t")
    assert [o.finish_reason for o in engine.step()] == ["abort"]


def test_generate_puts_back_what_it_took_when_a_step_fails() -> None:
    engine = _engine()
    engine.add_request("someone else", SamplingParams(max_tokens=30), request_id="other")
    engine.step()
    engine.abort("other")  # its final output waits for the next step
    _fail_next_execute(engine)
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate(["mine"], SamplingParams(max_tokens=4, n=2))
    outs = engine.step()  # generate's own requests were aborted and dropped
    assert [(o.request_id, o.finish_reason) for o in outs] == [("other", "abort")]
    assert not engine.has_unfinished
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks


# ---------------------------------------------------------------- sample ids and n > 1
@pytest.mark.parametrize("rid", ["x#1", "#", "a#b", "x#"])
def test_request_ids_with_the_fork_separator_are_rejected(rid: str) -> None:
    engine = _engine()
    engine.add_request(
        "fork me", SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=1), request_id="x"
    )
    with pytest.raises(InvalidArgument, match="request_id") as err:
        engine.add_request("sneaky", SamplingParams(max_tokens=4), request_id=rid)
    assert type(err.value) is InvalidArgument
    assert set(engine.scheduler.requests) == {"x"}
    final = _run(engine)
    assert sorted(final) == [("x", 0), ("x", 1), ("x", 2)]
    assert all(len(o.token_ids) == 4 for o in final.values())


def _n3() -> SamplingParams:
    return SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=4)


@pytest.mark.parametrize("steps_before", [0, 1])
def test_abort_before_the_first_token_ends_every_sample(steps_before: int) -> None:
    # A 40-token prompt at 16 tokens a step is still in prefill after one step.
    engine = _engine()
    engine.add_request([256] + [7] * 39, _n3(), request_id="x")
    engine.add_request("neighbour", SamplingParams(max_tokens=3), request_id="y")
    outs: list[RequestOutput] = []
    for _ in range(steps_before):
        outs.extend(engine.step())
    assert not any(o.request_id == "x" for o in outs)
    engine.abort("x")
    outs.extend(engine.step())
    mine = sorted(
        (o.index, o.finished, o.finish_reason, o.token_ids) for o in outs if o.request_id == "x"
    )
    assert mine == [(i, True, "abort", ()) for i in range(3)]
    assert {o.metrics.finish_reason for o in outs if o.request_id == "x"} == {"abort"}
    final = _run(engine)
    assert set(final) == {("y", 0)}


def test_timeout_before_the_first_token_ends_every_sample() -> None:
    now = [0.0]
    cfg = SchedulerConfig(
        max_num_batched_tokens=16,
        block_size=4,
        num_blocks=64,
        max_model_len=128,
        max_num_seqs=1,
        queue_timeout_ms=5.0,
    )
    engine = _engine(scheduler_config=cfg, clock=lambda: now[0])
    engine.add_request("hog", SamplingParams(max_tokens=6), request_id="hog")
    engine.step()
    engine.add_request("waits", _n3(), request_id="x")
    now[0] = 10.0
    final = _run(engine)
    assert [(i, final[("x", i)].finish_reason) for i in range(3)] == [
        (i, "timeout") for i in range(3)
    ]
    assert final[("hog", 0)].finish_reason == "length"


def test_a_token_outside_the_vocabulary_fails_the_step_not_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sampler that draws an id >= vocab_size must not be committed: the step fails with
    a typed error naming the token, rolls back, and the next step gives the right tokens."""
    (ref,) = _engine().generate(["hello"], SamplingParams(max_tokens=6))
    engine = _engine()
    engine.add_request("hello", SamplingParams(max_tokens=6), request_id="h")
    real = sample
    calls = [0]

    def out_of_vocab(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        drawn = real(*args, **kwargs)  # type: ignore[arg-type]
        if calls[0] == 2:
            return [(10**6, lp) for _, lp in drawn]
        return drawn

    monkeypatch.setattr("refserve.model.executor.sample", out_of_vocab)
    engine.step()
    with pytest.raises(ExecutorError, match="1000000"):
        engine.step()
    final = [o for o in engine.iter_outputs() if o.finished]
    assert [o.token_ids for o in final] == [ref.outputs[0].token_ids]
