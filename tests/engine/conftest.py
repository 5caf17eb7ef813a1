"""Fixtures for the engine tests: the transformers oracles (see ``hf_oracle``): ``hf``, a
Llama, and ``hybrid``, a Qwen2 with sliding-window layers in each of two mixes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_oracle import MIXES, HFOracle, build_hf_checkpoint, build_hybrid_oracle, hf_llama_config

from refserve.model.config import ModelConfig


@pytest.fixture(scope="session")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFOracle:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf-llama")
    hf_config = hf_llama_config(attn_implementation="eager")
    model = build_hf_checkpoint(path, hf_config)
    cfg = ModelConfig.from_hf(hf_config.to_dict())
    return HFOracle(model, path, cfg, {})


@pytest.fixture(scope="module", params=sorted(MIXES))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HFOracle:
    mix = MIXES[request.param]
    path = tmp_path_factory.mktemp(f"hf-qwen2-{mix.name.replace(':', '-')}")
    return build_hybrid_oracle(path, mix)
