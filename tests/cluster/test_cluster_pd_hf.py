"""Greedy tokens across the handoff equal Hugging Face transformers' (docs/DISAGG.md,
"In the cluster"): the oracle of the engine tests (tests/engine/hf_oracle.py, a small
random-weight Llama in fp32 saved with ``save_pretrained``, loaded by refserve's loader)
serves a ``2P2D`` in-process cluster, with and without deflection; every request's tokens
are ``generate(do_sample=False)``'s, whether it was handed off after its first token
with its K/V, deflected, or finished at its first token, and the rules of spec/pd.py
hold after every step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

# The transformers oracle of the engine tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from hf_oracle import HFOracle, build_hf_checkpoint, hf_llama_config, random_prompt
from pd_helpers import CFG, EVERY, ROLES, Run

from refserve.cluster import Cluster
from refserve.cluster.disagg import Deflection
from refserve.model.config import ModelConfig
from refserve.model.sampler import SamplingParams


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFOracle:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf-llama-pd")
    hf_config = hf_llama_config(attn_implementation="eager")
    model = build_hf_checkpoint(path, hf_config)
    return HFOracle(model, path, ModelConfig.from_hf(hf_config.to_dict()), {})


@pytest.mark.parametrize("deflection", [None, EVERY], ids=["handoff", "deflected"])
def test_greedy_tokens_across_the_handoff_are_transformers(
    hf: HFOracle, deflection: Deflection | None
) -> None:
    gen = torch.Generator().manual_seed(11)
    work = [
        (f"h{i}", random_prompt(gen, 6 + 3 * i), SamplingParams(max_tokens=1 + (5 * i) % 9))
        for i in range(8)
    ]
    cluster = Cluster.in_process(
        4, model=str(hf.path), scheduler_config=CFG, roles=ROLES, deflection=deflection
    )
    run = Run(cluster)
    run.add(work)
    finals = run.to_end()
    assert finals == {(rid, 0): hf.greedy(p, s.max_tokens) for rid, p, s in work}
    assert run.handed_off and cluster.metrics.handoffs == len(run.handed_off)
    assert (cluster.metrics.deflections > 0) == (deflection is not None)
