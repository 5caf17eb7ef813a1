"""A hybrid sliding-window model is token-for-token transformers' (the oracle).

The model is transformers' ``Qwen2ForCausalLM`` (q/k/v biases) with per-layer
``layer_types``: some layers attend within a sliding window of ``W`` keys (a query at
position ``p`` sees keys ``p - W < k <= p``, transformers' ``sliding_window_overlay``),
the others to every earlier token. Two mixes, sliding:full 1:1 (``W`` = 8, a multiple
of the block size 4) and 5:1 (``W`` = 13, not one), each with seeded random weights and
an embedded config, saved with ``save_pretrained`` and read by refserve's loader.

Prompts are longer than the window (20-60 tokens) and outputs 20+ tokens, under
continuous batching, chunked prefill, prefix caching, and preemption by recompute and
by swap; every run is checked against ``generate(do_sample=False)`` run alone, and one
against a full transformers forward logit by logit. Two checks make the rest able to
fail: the same weights with every layer full give other tokens (the window matters),
and K/V poisoned before the window changes nothing in a sliding layer (it is never
read) but changes the tokens in a full layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hf_oracle import VOCAB, HFOracle, random_prompt
from test_engine_equivalence import ATOL, RTOL, Job, assert_matches_hf, run_jobs

from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine
from refserve.errors import InvalidArgument
from refserve.kernels import oracle
from refserve.model.attention import AttentionMetadata, TorchAttention
from refserve.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    UnsupportedModel,
)
from refserve.model.sampler import SamplingParams
from refserve.model.weights import load_checkpoint

transformers = pytest.importorskip("transformers")

S, F = SLIDING_ATTENTION, FULL_ATTENTION
BLOCK = 4


def jobs_of(seed: int, lengths: Sequence[int], max_tokens: Sequence[int]) -> list[Job]:
    g = torch.Generator().manual_seed(seed)
    return [
        Job(f"r{i}", random_prompt(g, n), m, arrive_step=i)
        for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))
    ]


# ------------------------------------------------------------------- the config
def test_loaded_config_reads_the_layers(hybrid: HFOracle) -> None:
    cfg = hybrid.config
    assert cfg.model_type == "qwen2" and cfg.attention_bias and cfg.is_hybrid
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    assert windows == [cfg.sliding_window if k == S else None for k in cfg.layer_types]


def test_layers_from_max_window_layers_as_transformers_derives_them() -> None:
    # No layer_types in config.json: sliding from layer max_window_layers on.
    hf_cfg = transformers.Qwen2Config(
        num_hidden_layers=5, use_sliding_window=True, sliding_window=6, max_window_layers=3
    )
    raw = hf_cfg.to_dict()
    want = tuple(raw.pop("layer_types"))
    cfg = ModelConfig.from_hf(raw)
    assert cfg.layer_types == want == (F, F, F, S, S)
    assert cfg.sliding_window == 6
    # use_sliding_window false: transformers drops the window, every layer is full.
    off = transformers.Qwen2Config(num_hidden_layers=3, sliding_window=6).to_dict()
    cfg = ModelConfig.from_hf(off)
    assert cfg.sliding_window is None and cfg.attention_kinds == (F, F, F) and not cfg.is_hybrid
    assert cfg.layer_types == ()  # the plain model's spelling


BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"sliding_window": 0, "layer_types": (S, F)}, "sliding_window"),
        ({"sliding_window": -3, "layer_types": (S, F)}, "sliding_window"),
        ({"sliding_window": 2.5, "layer_types": (S, F)}, "sliding_window"),
        ({"sliding_window": True, "layer_types": (S, F)}, "sliding_window"),
        ({"sliding_window": 8, "layer_types": (S,)}, "layer_types has 1 entries for 2 layers"),
        ({"sliding_window": 8, "layer_types": (S, F, F)}, "layer_types has 3 entries"),
        ({"sliding_window": 8, "layer_types": (S, "chunked_attention")}, "chunked_attention"),
        ({"sliding_window": 8, "layer_types": [S, F]}, "layer_types must be a tuple"),
        ({"layer_types": (F, S)}, "layer_types[1] is sliding_attention but there is no"),
    ],
)
def test_bad_layer_configs_are_refused_by_name(fields: dict[str, object], words: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        ModelConfig(**BASE, **fields)  # type: ignore[arg-type]
    assert words in str(e.value)


def test_bad_hf_layer_configs_are_refused_by_name() -> None:
    raw = {
        "model_type": "qwen2",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "use_sliding_window": True,
        "sliding_window": 8,
        "layer_types": [S, F],
    }
    assert ModelConfig.from_hf(raw).layer_types == (S, F)
    with pytest.raises(InvalidArgument, match="layer_types has 3 entries"):
        ModelConfig.from_hf({**raw, "layer_types": [S, F, F]})
    with pytest.raises(InvalidArgument, match="layer_types has 3 entries"):
        ModelConfig.from_hf({**raw, "layer_types": [F, F, F]})
    with pytest.raises(InvalidArgument, match="'hybrid'"):
        ModelConfig.from_hf({**raw, "layer_types": [S, "hybrid"]})
    with pytest.raises(InvalidArgument, match="sliding_window"):
        ModelConfig.from_hf({**raw, "sliding_window": 0})
    with pytest.raises(UnsupportedModel, match="layer_types must be a list of strings"):
        ModelConfig.from_hf({**raw, "layer_types": [S, 1]})
    # Llama has no sliding layers in transformers: a window there is refused, not ignored.
    with pytest.raises(UnsupportedModel, match="use_sliding_window"):
        ModelConfig.from_hf({**raw, "model_type": "llama"})


def test_checkpoint_with_a_bad_window_names_the_file(tmp_path: Path, hybrid: HFOracle) -> None:
    import json
    import shutil

    shutil.copytree(hybrid.path, tmp_path / "ckpt")
    cfg_file = tmp_path / "ckpt" / "config.json"
    raw = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**raw, "sliding_window": 0}))
    with pytest.raises(InvalidArgument, match=r"config\.json: sliding_window must be an int"):
        load_checkpoint(tmp_path / "ckpt")


# ------------------------------------------------------------------- equivalence
def test_batched_requests_match_transformers(hybrid: HFOracle) -> None:
    jobs = jobs_of(11, [20, 47, 33, 60, 26], [24, 20, 22, 21, 25])
    cfg = SchedulerConfig(max_num_batched_tokens=128, block_size=BLOCK, num_blocks=256)
    run = run_jobs(hybrid, jobs, cfg)
    assert_matches_hf(hybrid, run, jobs)
    assert run.max_batch >= 3


def test_the_window_changes_the_tokens(hybrid: HFOracle) -> None:
    """The same weights with every layer full attention give other greedy tokens, so the
    equivalence checks here could not pass with the window ignored."""
    cfg, weights = load_checkpoint(hybrid.path)
    full = dataclasses.replace(cfg, layer_types=(F,) * cfg.num_layers)
    jobs = jobs_of(11, [20, 47, 33, 60, 26], [24, 20, 22, 21, 25])
    engine = LLMEngine((full, weights))
    outs = engine.generate([j.prompt for j in jobs], SamplingParams(max_tokens=24))
    differ = []
    for j, o in zip(jobs, outs, strict=True):
        mine, want = o.outputs[0].token_ids, hybrid.greedy(j.prompt, j.max_tokens)
        n = min(len(mine), len(want))
        if mine[:n] != want[:n]:
            differ.append(j.rid)
    assert len(differ) >= 3, differ


@pytest.mark.parametrize("budget", [5, 16])
def test_chunked_prefill_matches_transformers_logit_by_logit(hybrid: HFOracle, budget: int) -> None:
    # Budgets 5 and 16 end the chunks at many offsets relative to blocks and the window.
    jobs = jobs_of(12, [23, 41, 30], [22, 20, 21])
    cfg = SchedulerConfig(max_num_batched_tokens=budget, block_size=BLOCK, num_blocks=256)
    run = run_jobs(hybrid, jobs, cfg, record_logits=True)
    assert_matches_hf(hybrid, run, jobs)
    chunks = [
        n
        for s in run.engine.steps
        for n, p in zip(s.plan.num_new_tokens, s.plan.is_prefill, strict=True)
        if p
    ]
    assert max(chunks) <= budget and len(chunks) > len(jobs)
    for j in jobs:
        full = j.prompt + list(run.finals[(j.rid, 0)].token_ids)
        ref = hybrid.logits(full)[len(j.prompt) - 1 : len(full) - 1]
        torch.testing.assert_close(torch.stack(run.logits[j.rid]), ref, atol=ATOL, rtol=RTOL)


def test_shared_prefix_reuses_cached_blocks(hybrid: HFOracle) -> None:
    g = torch.Generator().manual_seed(13)
    prefix = random_prompt(g, 42)  # 10 full blocks of 4 and a partial one
    jobs = [
        Job(f"p{i}", prefix + torch.randint(3, VOCAB, (k,), generator=g).tolist(), m, at)
        for i, (k, m, at) in enumerate([(6, 22, 0), (3, 24, 4), (11, 20, 5)])
    ]
    cfg = SchedulerConfig(
        max_num_batched_tokens=16, block_size=BLOCK, num_blocks=256, enable_prefix_caching=True
    )
    run = run_jobs(hybrid, jobs, cfg)
    assert_matches_hf(hybrid, run, jobs)
    for j in jobs[1:]:
        assert run.finals[(j.rid, 0)].metrics.num_cached_tokens >= 40


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches_transformers(hybrid: HFOracle, mode: str) -> None:
    # 20 blocks of 4 tokens for four requests of up to 70 tokens each.
    jobs = jobs_of(14, [22, 35, 28, 40], [24, 22, 26, 20])
    cfg = SchedulerConfig(
        max_num_batched_tokens=32,
        block_size=BLOCK,
        num_blocks=20,
        preemption_mode=mode,  # type: ignore[arg-type]  # the str form is accepted
        num_host_blocks=64 if mode == "swap" else 0,
    )
    run = run_jobs(hybrid, jobs, cfg)
    assert_matches_hf(hybrid, run, jobs)
    assert run.engine.num_preemptions >= 2
    swapped = [rid for s in run.engine.steps for rid in s.plan.swapped_out]
    if mode == "swap":
        assert len(swapped) >= 2 and run.engine.swap_in_bytes > 0
    else:
        assert not swapped


# ------------------------------------------------------------------- the window is all it reads
def _poisoned_run(
    hybrid: HFOracle, prompt: list[int], layers: Sequence[int], garbage: float
) -> tuple[int, ...]:
    """Greedy tokens when, right after the prefill, the K and V at every position the
    next queries' windows no longer reach are overwritten with ``garbage`` in ``layers``."""
    window = hybrid.config.sliding_window
    assert window is not None
    engine = LLMEngine(
        str(hybrid.path),
        scheduler_config=SchedulerConfig(block_size=BLOCK, num_blocks=64),
        check_invariants=True,
    )
    rid = engine.add_request(prompt, SamplingParams(max_tokens=24))
    first = engine.step()  # the whole prompt in one step, and its first token
    assert first and len(first[0].token_ids) == 1
    table = engine.scheduler.pool.block_table(rid)
    # The next query sits at position len(prompt) and sees keys > len(prompt) - window.
    stale = range(len(prompt) - window + 1)
    cache = engine.executor.cache
    for layer in layers:
        for pos in stale:
            block, offset = table[pos // BLOCK], pos % BLOCK
            cache.key[layer][block, offset] = garbage
            cache.value[layer][block, offset] = garbage
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                return out.token_ids
    raise AssertionError("the request did not finish")


def test_sliding_layers_never_read_before_their_window(hybrid: HFOracle) -> None:
    g = torch.Generator().manual_seed(15)
    prompt = random_prompt(g, 44)
    want = hybrid.greedy(prompt, 24)
    cfg = hybrid.config
    sliding = [i for i, k in enumerate(cfg.layer_types) if k == S]
    full = [i for i, k in enumerate(cfg.layer_types) if k == F]
    # NaN would poison any softmax that read it, even masked (0 * NaN is NaN).
    assert _poisoned_run(hybrid, prompt, sliding, float("nan")) == want
    assert _poisoned_run(hybrid, prompt, sliding, 1e3) == want
    # The same slots in one full layer are read, and change what it generates.
    assert _poisoned_run(hybrid, prompt, full[:1], 1e3) != want


# ------------------------------------------------------------------- against the kernels' oracle
@pytest.mark.parametrize("window", [1, 3, 8, 13, 100])
def test_torch_window_matches_the_kernel_oracle(window: int) -> None:
    """TorchAttention's window agrees with ``refserve.kernels.oracle.paged_attention``'s on a
    random paged batch: a whole prompt, mid-prompt chunks, decodes, shuffled blocks."""
    g = torch.Generator().manual_seed(window)
    hq, hkv, d, bs, num_blocks = 4, 2, 16, BLOCK, 64
    kv_lens = [37, 20, 9, 51, 1]
    q_lens = [37, 6, 1, 1, 1]
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    max_blocks = -(-max(kv_lens) // bs)
    tables = torch.zeros((len(kv_lens), max_blocks), dtype=torch.int32)
    used = 0
    for s, n in enumerate(kv_lens):
        nb = -(-n // bs)
        tables[s, :nb] = perm[used : used + nb]
        used += nb
    key_cache = torch.randn((num_blocks, bs, hkv, d), generator=g)
    value_cache = torch.randn((num_blocks, bs, hkv, d), generator=g)
    query = torch.randn((sum(q_lens), hq, d), generator=g)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64),  # unused by attend
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_tables=tables,
        query_start_loc_host=tuple(qsl),
        seq_lens_host=tuple(kv_lens),
    )
    scale = d**-0.5
    mine = TorchAttention().attend(query, key_cache, value_cache, meta, scale, window)
    ref = oracle.paged_attention(
        query,
        key_cache,
        value_cache,
        tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale=scale,
        sliding_window=window,
    )
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
    full = oracle.paged_attention(
        query, key_cache, value_cache, tables, meta.seq_lens, meta.query_start_loc, scale=scale
    )
    # A window shorter than the longest context changes the result (the case can fail).
    assert (window < max(kv_lens)) == (not torch.allclose(ref, full, atol=1e-5))


TRITON_CHECK = """
import torch
from refserve.core.config import SchedulerConfig
from refserve.engine.llm_engine import LLMEngine, SamplingParams
from refserve.model.config import ModelConfig
from refserve.model.weights import random_weights

kinds = ("sliding_attention", "full_attention")
cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True, model_type="qwen2",
    sliding_window=5, layer_types=kinds)
w = random_weights(cfg, 3)
sc = SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=64)
prompts = [[1] + list(range(10, 27)), [1] + list(range(40, 51))]

def logits(c, backend):
    e = LLMEngine((c, w), scheduler_config=sc, attention_backend=backend)
    rows = {}
    e.executor.logits_hook = lambda rids, lg: [
        rows.setdefault(r, []).append(lg[i].clone()) for i, r in enumerate(rids)]
    e.generate(prompts, SamplingParams(max_tokens=4))
    return torch.cat([torch.stack(rows[r]) for r in sorted(rows)])

mine = logits(cfg, "torch")
torch.testing.assert_close(logits(cfg, "triton"), mine, atol=1e-4, rtol=1e-4)
full = ModelConfig(**{**cfg.__dict__, "layer_types": ("full_attention",) * 2})
assert (logits(full, "torch") - mine).abs().max() > 1e-2, "the window changed nothing"
"""


def test_triton_backend_applies_the_window() -> None:
    """The Triton backend passes each layer's window to ``paged_attention``: its logits
    are the torch backend's on a hybrid model (a window of 5 over prompts of 12 and 18,
    chunked by 8), where the window moves them (run in a subprocess: ``TRITON_INTERPRET``
    must be set before triton is imported)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
