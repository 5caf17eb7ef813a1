"""The engine API on the embedded tiny model: streaming, stop strings, abort, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from refserve.cli.demo import demo_main
from refserve.cli.generate import generate_main
from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import InvalidPrompt, LLMEngine, RequestOutput
from refserve.errors import DuplicateRequest, ExceedsCapacity, InvalidArgument, UnknownRequest
from refserve.model.attention import BackendUnavailable, TritonAttention, make_backend
from refserve.model.sampler import InvalidSamplingParams, SamplingParams
from refserve.model.tokenizer import ByteTokenizer


def _engine(**kw: object) -> LLMEngine:
    cfg = kw.pop("scheduler_config", None) or SchedulerConfig(
        max_num_batched_tokens=16, block_size=4, num_blocks=64, max_model_len=128
    )
    return LLMEngine("tiny", scheduler_config=cfg, check_invariants=True, **kw)  # type: ignore[arg-type]


def test_step_outputs_stream_deltas() -> None:
    engine = _engine()
    rid = engine.add_request("Hello", SamplingParams(max_tokens=6, logprobs=True))
    outs: list[RequestOutput] = []
    while engine.has_unfinished:
        outs.extend(engine.step())
    assert all(o.request_id == rid for o in outs)
    assert [len(o.new_token_ids) for o in outs] == [1] * 6
    final = outs[-1]
    assert final.finished and final.finish_reason == "length"
    assert final.token_ids == tuple(t for o in outs for t in o.new_token_ids)
    assert "".join(o.new_text for o in outs) == final.text
    assert final.text == ByteTokenizer().decode(final.token_ids)
    assert final.logprobs is not None and len(final.logprobs) == 6
    m = final.metrics
    assert m.num_prompt_tokens == 6 and m.num_output_tokens == 6
    assert m.ttft_ms is not None and m.ttft_ms >= 0 and len(m.itl_ms) == 5


def test_stream_iterator_keeps_other_outputs_for_step() -> None:
    engine = _engine()
    other = engine.add_request("other", SamplingParams(max_tokens=3))
    mine = list(engine.stream("mine", SamplingParams(max_tokens=4)))
    assert [o.request_id for o in mine] == ["req-1"] * 4 and mine[-1].finished
    held = engine.step()
    assert held and {o.request_id for o in held} == {other}
    assert any(o.finished for o in held)


def test_requests_join_between_steps_and_generate() -> None:
    engine = _engine()
    a = engine.add_request([256, 72, 105], SamplingParams(max_tokens=8))
    engine.step()
    engine.step()
    b = engine.add_request("late", SamplingParams(max_tokens=2))
    done: dict[str, RequestOutput] = {}
    for o in engine.iter_outputs():
        if o.finished:
            done[o.request_id] = o
    assert set(done) == {a, b}
    # generate: the same prompt alone gives the same greedy tokens as in the batch above.
    (res,) = _engine().generate([[256, 72, 105]], SamplingParams(max_tokens=8))
    assert res.outputs[0].token_ids == done[a].token_ids
    assert res.prompt_token_ids == (256, 72, 105)


def test_stop_string_ends_the_request() -> None:
    engine = _engine()
    (free,) = engine.generate(["stop test"], SamplingParams(max_tokens=12))
    text = free.outputs[0].text
    # Use a 2-character piece of the greedy continuation as a stop string.
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    cut = text.index(stop)
    (res,) = _engine().generate(["stop test"], SamplingParams(max_tokens=12, stop=(stop,)))
    out = res.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut]
    assert len(out.token_ids) < 12
    (inc,) = _engine().generate(
        ["stop test"], SamplingParams(max_tokens=12, stop=(stop,), include_stop_str_in_output=True)
    )
    assert inc.outputs[0].text == text[: cut + len(stop)]


def test_abort_in_flight_returns_pool_and_final_output() -> None:
    engine = _engine()
    a = engine.add_request("first", SamplingParams(max_tokens=30))
    b = engine.add_request("second", SamplingParams(max_tokens=5))
    engine.step()
    engine.step()
    engine.abort(a)
    with pytest.raises(UnknownRequest):
        engine.abort(a)
    outs = engine.step()
    final_a = [o for o in outs if o.request_id == a]
    assert final_a and final_a[0].finished and final_a[0].finish_reason == "abort"
    rest = list(engine.iter_outputs())
    assert rest[-1].request_id == b and rest[-1].finish_reason == "length"
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks
    with pytest.raises(UnknownRequest):
        engine.abort("nope")


BAD: list[tuple[str, Callable[[LLMEngine], object], type[Exception]]] = [
    ("empty str", lambda e: e.add_request(""), InvalidPrompt),
    ("empty ids", lambda e: e.add_request([]), InvalidPrompt),
    ("id >= vocab", lambda e: e.add_request([1, 259]), InvalidPrompt),
    ("negative id", lambda e: e.add_request([1, -3]), InvalidPrompt),
    ("non-int id", lambda e: e.add_request([1, 2.0]), InvalidPrompt),  # type: ignore[list-item]
    ("bytes prompt", lambda e: e.add_request(b"hi"), InvalidPrompt),
    ("max_tokens 0", lambda e: e.add_request("x", {"max_tokens": 0}), InvalidSamplingParams),
    ("too long", lambda e: e.add_request([1] * 128), InvalidPrompt),
    ("unknown option", lambda e: e.add_request("x", {"beam_width": 2}), InvalidSamplingParams),
    ("top_p 0", lambda e: e.add_request("x", {"top_p": 0.0}), InvalidSamplingParams),
    ("top_p > 1", lambda e: e.add_request("x", {"top_p": 1.01}), InvalidSamplingParams),
    ("temperature < 0", lambda e: e.add_request("x", {"temperature": -1}), InvalidSamplingParams),
    ("duplicate id", lambda e: e.add_request("x", request_id="keep"), DuplicateRequest),
    ("bad params type", lambda e: e.add_request("x", 3), InvalidSamplingParams),  # type: ignore[arg-type]
    ("bad request id", lambda e: e.add_request("x", request_id=""), InvalidArgument),
]


def test_bad_input_is_rejected_and_running_requests_are_unaffected() -> None:
    (ref,) = _engine().generate(["keep going"], SamplingParams(max_tokens=40))
    engine = _engine()
    engine.add_request("keep going", SamplingParams(max_tokens=40), request_id="keep")
    outs = engine.step()
    for name, call, exc in BAD:
        with pytest.raises(exc):
            call(engine)
        assert set(engine.books.request_ids) == {"keep"}, name
        assert set(engine.scheduler.requests) == {"keep"}, name
        outs.extend(engine.step())
    outs.extend(engine.iter_outputs())
    assert [o.token_ids for o in outs if o.finished] == [ref.outputs[0].token_ids]


def test_prompt_bigger_than_the_pool_is_rejected() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=16, block_size=4, num_blocks=4)
    engine = _engine(scheduler_config=cfg)
    with pytest.raises(ExceedsCapacity):
        engine.add_request([1] * 40)
    assert not engine.has_unfinished


def test_generate_rejects_a_bad_prompt_and_leaves_nothing_behind() -> None:
    engine = _engine()
    keep = engine.add_request("running", SamplingParams(max_tokens=4))
    with pytest.raises(InvalidPrompt):
        engine.generate(["fine", ""], SamplingParams(max_tokens=3))
    assert set(engine.books.request_ids) == {keep}
    assert [o.request_id for o in engine.iter_outputs()] == [keep] * 4


def test_unknown_attention_backend() -> None:
    with pytest.raises(InvalidArgument, match="attention backend"):
        make_backend("flash")


def test_triton_backend_unavailable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        sys.modules, "refserve.kernels", None
    )  # import refserve.kernels -> ImportError
    with pytest.raises(BackendUnavailable, match="triton"):
        TritonAttention()


@pytest.mark.slow
def test_triton_backend_matches_torch_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    code = (
        "from refserve.engine.llm_engine import LLMEngine, SamplingParams\n"
        "from refserve.core.config import SchedulerConfig\n"
        "cfg = SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=32)\n"
        "sp = SamplingParams(max_tokens=4, n=2)\n"
        "out = {}\n"
        "for b in ('torch', 'triton'):\n"
        "    e = LLMEngine('tiny', scheduler_config=cfg, attention_backend=b)\n"
        "    out[b] = [o.token_ids for r in e.generate(['ab', 'hello'], sp) for o in r.outputs]\n"
        "assert out['torch'] == out['triton'], out\n"
    )
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_demo_main_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    picture = tmp_path / "timeline.html"
    assert demo_main(picture) == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "ttft" in out and "preemptions" in out
    assert str(picture) in out
    assert "<svg" in picture.read_text()


def test_generate_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert generate_main(["--prompt", "Hi", "--max-tokens", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["outputs"][0]["token_ids"]) == 3
    assert doc["outputs"][0]["finish_reason"] == "length"
    assert generate_main(["--prompt-ids", "256,72", "--max-tokens", "2"]) == 0
    assert "tokens:" in capsys.readouterr().out
    assert generate_main(["--prompt-ids", "1,999"]) == 2
    assert "999" in capsys.readouterr().err
