"""The embedded trained model ``tiny-trained``: shipped, reproducible, and exact.

The shipped checkpoint loads with the ordinary loader, its ``config.json`` is what the
trainer writes, its greedy output through refserve's engine is token for token that of
transformers' ``generate`` on the same directory, the trainer is deterministic, and it is
what ``refserve generate`` uses by default. The random-weight ``"tiny"`` stays the model
of every other engine test.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from refserve.engine.llm_engine import LLMEngine
from refserve.model.sampler import SamplingParams
from refserve.model.tiny import TRAINED_DIR
from refserve.model.tiny.corpus import documents
from refserve.model.tokenizer import ByteTokenizer
from refserve.model.train_tiny import hf_config, train
from refserve.model.weights import load_checkpoint

PROMPTS = ["The cat", "You are a terse assistant. Name a prime.", "One day, the"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def greedy() -> list[tuple[int, ...]]:
    """refserve's greedy output ids for ``PROMPTS``, batched in one engine."""
    results = LLMEngine("tiny-trained").generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    return [tuple(r.outputs[0].token_ids) for r in results]


def test_shipped_config_is_what_the_trainer_writes() -> None:
    shipped = json.loads((TRAINED_DIR / "config.json").read_text())
    assert shipped == hf_config()
    cfg, weights = load_checkpoint(TRAINED_DIR)
    tok = ByteTokenizer()
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id) == (
        tok.vocab_size,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    assert len(weights.layers) == shipped["num_hidden_layers"]


def test_greedy_output_equals_transformers_generate(greedy: list[tuple[int, ...]]) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(TRAINED_DIR, dtype=torch.float32).eval()
    tok = ByteTokenizer()
    for prompt, ids_out in zip(PROMPTS, greedy, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=ByteTokenizer.PAD,
            )
        assert ids_out == tuple(out[0, ids.shape[1] :].tolist()), prompt


def test_greedy_output_is_english_words(greedy: list[tuple[int, ...]]) -> None:
    corpus_words = set(re.findall(r"[a-z]+", " ".join(documents()).lower()))
    for ids in greedy:
        text = ByteTokenizer().decode(ids)
        # The last word may be cut off by max_tokens.
        words = re.findall(r"[a-z]+", text.lower())[:-1]
        assert len(words) >= 3, text
        assert all(w in corpus_words for w in words), text


def test_training_is_deterministic() -> None:
    cfg = hf_config(hidden=32, intermediate=64, layers=1, heads=2, kv_heads=1)
    docs = documents(0, 4000)
    a = train(cfg, docs, steps=5, batch_size=4, seq_len=32)
    b = train(cfg, docs, steps=5, batch_size=4, seq_len=32)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.are_deterministic_algorithms_enabled()  # restored for the session
    init = train(cfg, docs, steps=0, batch_size=4, seq_len=32)
    assert not torch.equal(a["lm_head.weight"], init["lm_head.weight"])


def test_generate_cli_defaults_to_the_trained_model(
    greedy: list[tuple[int, ...]], capsys: pytest.CaptureFixture[str]
) -> None:
    from refserve.cli.generate import generate_main

    assert generate_main(["--prompt", PROMPTS[0], "--max-tokens", "24", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "tiny-trained"
    assert tuple(doc["outputs"][0]["token_ids"]) == greedy[0][:24]
