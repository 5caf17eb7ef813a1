"""The checkpoint loader: local HF directories only, every tensor checked by name and shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_oracle import BOS, HFOracle, build_hf_checkpoint, hf_llama_config, random_prompt

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine
from refserve.model.config import ModelConfig, UnsupportedModel, tiny_config
from refserve.model.sampler import SamplingParams
from refserve.model.weights import (
    WeightError,
    WeightMismatch,
    WeightMissing,
    WeightUnexpected,
    load_checkpoint,
    random_state_dict,
    random_weights,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _copy_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dict(safetensors_torch.load_file(str(src / "model.safetensors")))


def test_loader_reads_what_transformers_saved(hf: HFOracle) -> None:
    cfg, w = load_checkpoint(hf.path)
    assert cfg == hf.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (4, 2, 24, 5000.0)
    assert cfg.head_dim != cfg.hidden_size // cfg.num_heads
    sd = hf.model.state_dict()
    assert torch.equal(w.layers[1].k_proj, sd["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(w.lm_head, sd["lm_head.weight"])


def test_missing_tensor_is_named(hf: HFOracle, tmp_path: Path) -> None:
    d = tmp_path / "ck"
    tensors = _copy_checkpoint(hf.path, d)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors_torch.save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightMissing, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(d)


def test_mismatched_tensor_is_named(hf: HFOracle, tmp_path: Path) -> None:
    d = tmp_path / "ck"
    tensors = _copy_checkpoint(hf.path, d)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    safetensors_torch.save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightMismatch, match=r"self_attn\.k_proj\.weight.*\[64, 64\].*\[48, 64\]"):
        load_checkpoint(d)


def test_unexpected_tensor_is_named(hf: HFOracle, tmp_path: Path) -> None:
    d = tmp_path / "ck"
    tensors = _copy_checkpoint(hf.path, d)
    tensors["model.layers.0.extra.weight"] = torch.zeros(3)
    safetensors_torch.save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightUnexpected, match=r"model\.layers\.0\.extra\.weight"):
        load_checkpoint(d)


def test_sharded_checkpoint_and_bad_directories(hf: HFOracle, tmp_path: Path) -> None:
    d = tmp_path / "sharded"
    tensors = _copy_checkpoint(hf.path, d)
    names = sorted(tensors)
    half = len(names) // 2
    safetensors_torch.save_file({n: tensors[n] for n in names[:half]}, str(d / "a.safetensors"))
    safetensors_torch.save_file({n: tensors[n] for n in names[half:]}, str(d / "b.safetensors"))
    cfg, _ = load_checkpoint(d)
    assert cfg == hf.config
    with pytest.raises(WeightError, match=r"no config\.json"):
        load_checkpoint(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((hf.path / "config.json").read_text())
    with pytest.raises(WeightError, match=r"no \*\.safetensors"):
        load_checkpoint(empty)


def test_unsupported_config_is_rejected(hf: HFOracle, tmp_path: Path) -> None:
    raw = json.loads((hf.path / "config.json").read_text())
    for patch in (
        {"model_type": "gpt2"},
        {"hidden_act": "gelu"},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}},
    ):
        with pytest.raises(UnsupportedModel):
            ModelConfig.from_hf({**raw, **patch})


def _compare_logits(engine: LLMEngine, model: object, prompt: list[int], n: int) -> None:
    rows: list[torch.Tensor] = []
    engine.executor.logits_hook = lambda rids, lg: rows.append(lg[0].clone())
    (res,) = engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    full = prompt + list(res.outputs[0].token_ids)
    with torch.inference_mode():
        ref = model(torch.tensor([full])).logits[0, len(prompt) - 1 : -1].float()  # type: ignore[operator]
    torch.testing.assert_close(torch.stack(rows), ref, atol=2e-5, rtol=1e-5)


def test_tied_head_checkpoint(tmp_path: Path) -> None:
    cfg = hf_llama_config(tie_word_embeddings=True, num_key_value_heads=1, head_dim=None)
    model = build_hf_checkpoint(tmp_path, cfg, seed=5)
    ours, w = load_checkpoint(tmp_path)
    assert ours.tie_word_embeddings and w.lm_head is w.embed
    engine = LLMEngine(str(tmp_path), scheduler_config=SchedulerConfig(block_size=4))
    g = torch.Generator().manual_seed(0)
    _compare_logits(engine, model, random_prompt(g, 9), 6)


def test_qwen2_checkpoint_with_qkv_bias(tmp_path: Path) -> None:
    qcfg = transformers.Qwen2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=20000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=2,
        attn_implementation="eager",
    )
    model = build_hf_checkpoint(tmp_path, qcfg, transformers.Qwen2ForCausalLM, seed=9)
    ours, w = load_checkpoint(tmp_path)
    assert ours.model_type == "qwen2" and ours.attention_bias
    assert w.layers[0].q_bias is not None
    engine = LLMEngine(str(tmp_path), scheduler_config=SchedulerConfig(block_size=4))
    g = torch.Generator().manual_seed(1)
    _compare_logits(engine, model, random_prompt(g, 13), 5)


def test_random_weights_are_seeded() -> None:
    cfg = tiny_config()
    a, b, c = random_weights(cfg, 0), random_weights(cfg, 0), random_weights(cfg, 1)
    assert torch.equal(a.layers[0].q_proj, b.layers[0].q_proj)
    assert not torch.equal(a.layers[0].q_proj, c.layers[0].q_proj)
    assert set(random_state_dict(cfg)) >= {"model.embed_tokens.weight", "model.norm.weight"}
