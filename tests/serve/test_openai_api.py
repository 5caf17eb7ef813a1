"""refserve serve through the official ``openai`` client and ``httpx``: greedy output over
HTTP equals the engine's (and transformers'), streaming equals non-streaming, concurrency
changes nothing, and the schema is what the client expects."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import pytest
from serve_helpers import MODEL, PROMPTS, TIMEOUT_S, client, sse_events, start

from refserve.engine.llm_engine import LLMEngine
from refserve.model.sampler import SamplingParams
from refserve.serve.server import ServerThread

MAX_TOKENS = 12


def _greedy(
    reference: LLMEngine, prompt: str | list[int], **kw: object
) -> tuple[str, tuple[int, ...]]:
    (result,) = reference.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, **kw))  # type: ignore[arg-type]
    out = result.outputs[0]
    return out.text, out.token_ids


def test_greedy_completions_equal_the_engine(server: ServerThread, reference: LLMEngine) -> None:
    c = client(server)
    for prompt in PROMPTS:
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        text, ids = _greedy(reference, prompt)
        assert r.choices[0].text == text
        assert r.choices[0].finish_reason == "length"
        assert r.usage is not None
        assert r.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
        assert r.usage.completion_tokens == len(ids) == MAX_TOKENS
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_token_id_prompts_and_token_ids_in_logprobs(
    server: ServerThread, reference: LLMEngine
) -> None:
    prompt = [256, 72, 105, 33]
    r = client(server).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    _, ids = _greedy(reference, prompt)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    assert [int(t.removeprefix("token_id:")) for t in lp.tokens] == list(ids)
    assert lp.token_logprobs is not None and all(
        x is not None and x <= 0 for x in lp.token_logprobs
    )


def test_stop_string_and_stop_token(server: ServerThread, reference: LLMEngine) -> None:
    c = client(server)
    text, ids = _greedy(reference, "Hello")
    stop = text[3:5]
    r = c.completions.create(
        model=MODEL, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    want, _ = _greedy(reference, "Hello", stop=(stop,))
    assert r.choices[0].text == want and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    r = c.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"stop_token_ids": [ids[4]]},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == ids.index(ids[4]) + 1


def test_streamed_deltas_concatenate_to_the_text(server: ServerThread) -> None:
    c = client(server)
    for prompt in PROMPTS[:3]:
        for stop in (None, ["o"]):
            full = c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=stop
            )
            stream = c.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stop=stop,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts, usage, reasons = [], None, []
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for ch in chunk.choices:
                    parts.append(ch.text)
                    reasons.append(ch.finish_reason)
            assert "".join(parts) == full.choices[0].text
            assert reasons[-1] == full.choices[0].finish_reason
            assert all(r is None for r in reasons[:-1])
            assert usage == full.usage


def test_chat_stream_equals_chat(server: ServerThread) -> None:
    c = client(server)
    messages = [{"role": "user", "content": "Count to four."}]
    full = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )  # type: ignore[arg-type]
    parts, roles = [], []
    for chunk in c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    ):
        for ch in chunk.choices:
            roles.append(ch.delta.role)
            parts.append(ch.delta.content or "")
    assert roles[0] == "assistant"
    assert "".join(parts) == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    # The byte template (ref/serve/chat.py): one line per message, then "assistant:".
    assert full.usage is not None
    assert full.usage.prompt_tokens == len("user: Count to four.\nassistant:") + 1  # + BOS


def test_concurrent_requests_equal_one_at_a_time(server: ServerThread) -> None:
    c = client(server)
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 3)]

    def one(prompt: str) -> str:
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].text

    alone = [one(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(one, prompts, timeout=TIMEOUT_S))
    assert together == alone


def test_n_and_seed(server: ServerThread) -> None:
    c = client(server)
    kw = dict(model=MODEL, prompt="Hello", max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=3)
    a = c.completions.create(**kw)  # type: ignore[call-overload]
    b = c.completions.create(**kw)  # type: ignore[call-overload]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert len({ch.text for ch in a.choices}) == 3
    assert a.usage is not None and a.usage.completion_tokens == 3 * MAX_TOKENS


def test_models_health_metrics(server: ServerThread) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health", timeout=TIMEOUT_S).status_code == 200
    text = httpx.get(f"{server.base_url}/metrics", timeout=TIMEOUT_S).text
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
        "refserve:swapped_out_bytes_total",
    ):
        assert name in text, name


def test_raw_stream_chunks_are_openai_shaped(server: ServerThread) -> None:
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, timeout=TIMEOUT_S
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert all(e["object"] == "text_completion" and "usage" in e for e in events)
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


def test_greedy_over_http_equals_transformers(tmp_path: Path) -> None:
    """A saved random HF checkpoint served over HTTP: token ids (via logprobs) equal
    ``LlamaForCausalLM.generate(do_sample=False)``."""
    pytest.importorskip("transformers")
    import torch
    from hf_oracle import BOS, HFOracle, build_hf_checkpoint, hf_llama_config, random_prompt

    from refserve.model.config import ModelConfig

    torch.manual_seed(0)
    hf_config = hf_llama_config(attn_implementation="eager")
    model = build_hf_checkpoint(tmp_path, hf_config)
    oracle = HFOracle(model, tmp_path, ModelConfig.from_hf(hf_config.to_dict()), {})
    gen = torch.Generator().manual_seed(3)
    handle = start(model=tmp_path, name="hf-random")
    try:
        c = client(handle)
        for length in (3, 9, 20):
            prompt = random_prompt(gen, length)
            assert prompt[0] == BOS
            r = c.completions.create(
                model="hf-random",
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                logprobs=0,
                extra_body={"return_tokens_as_token_ids": True},
            )
            lp = r.choices[0].logprobs
            assert lp is not None and lp.tokens is not None
            got = tuple(int(t.removeprefix("token_id:")) for t in lp.tokens)
            assert got == oracle.greedy(prompt, 8)
    finally:
        handle.stop()
