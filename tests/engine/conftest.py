"""Fixtures for the engine tests: the transformers oracle (see ``hf_oracle``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_oracle import HFOracle, build_hf_checkpoint, hf_llama_config

from refserve.model.config import ModelConfig


@pytest.fixture(scope="session")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFOracle:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf-llama")
    hf_config = hf_llama_config(attn_implementation="eager")
    model = build_hf_checkpoint(path, hf_config)
    cfg = ModelConfig.from_hf(hf_config.to_dict())
    return HFOracle(model, path, cfg, {})
