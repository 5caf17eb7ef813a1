"""Train ``tiny-trained``: a small byte-level Llama on the generated corpus, on the CPU.

``make train-tiny`` runs ``python -m refserve.model.train_tiny`` and writes ``config.json``
and ``model.safetensors`` (Hugging Face Llama names, fp32) into ``ref/model/tiny/``,
where ``LLMEngine("tiny-trained")`` loads them with the ordinary checkpoint loader.

The model here is a plain-torch training twin of :mod:`refserve.model.llama` (RMSNorm,
rotate-half RoPE, GQA, SwiGLU, untied head) in full-sequence form; that refserve and
Hugging Face ``transformers`` then agree on the trained checkpoint is a test
(tests/engine/test_tiny_trained.py), so a mismatch here would show there.

Deterministic: one thread, fixed seeds, ``torch.use_deterministic_algorithms``; the same
command on the same machine and torch writes the same bytes. Other CPUs may round
differently (vector widths change summation order), so the shipped checkpoint is the
reference and retraining is only expected to be close, not identical.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from refserve.model.tiny import TRAINED_DIR
from refserve.model.tiny.corpus import documents
from refserve.model.tokenizer import ByteTokenizer


def hf_config(
    hidden: int = 128,
    intermediate: int = 384,
    layers: int = 3,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 1024,
) -> dict[str, Any]:
    """The ``config.json`` the trainer writes (and the shipped one must equal)."""
    tok = ByteTokenizer()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": ByteTokenizer.PAD,
        "torch_dtype": "float32",
    }


def init_params(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face names; N(0, 0.02) projections, ones for the norms (HF's own init)."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        out[name] = t.requires_grad_(True)
    return out


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def forward(p: dict[str, torch.Tensor], cfg: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, V]`` of a causal forward over ``ids`` ``[B, T]`` (positions 0..T-1)."""
    b, t = ids.shape
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(t).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = p["model.embed_tokens.weight"][ids]
    for n in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{n}."
        hn = _rms_norm(x, p[pre + "input_layernorm.weight"], eps)
        q = (hn @ p[pre + "self_attn.q_proj.weight"].T).view(b, t, hq, d).transpose(1, 2)
        k = (hn @ p[pre + "self_attn.k_proj.weight"].T).view(b, t, hkv, d).transpose(1, 2)
        v = (hn @ p[pre + "self_attn.v_proj.weight"].T).view(b, t, hkv, d).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(b, t, hq * d) @ p[pre + "self_attn.o_proj.weight"].T
        hn = _rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
        gate = F.silu(hn @ p[pre + "mlp.gate_proj.weight"].T)
        x = x + (gate * (hn @ p[pre + "mlp.up_proj.weight"].T)) @ p[pre + "mlp.down_proj.weight"].T
    x = _rms_norm(x, p["model.norm.weight"], eps)
    return x @ p["lm_head.weight"].T


def token_stream(docs: Sequence[str]) -> tuple[torch.Tensor, list[int]]:
    """Every document as BOS + bytes + EOS, concatenated; and where each one starts."""
    tok = ByteTokenizer()
    ids: list[int] = []
    starts: list[int] = []
    for doc in docs:
        starts.append(len(ids))
        ids += [*tok.encode(doc), tok.eos_token_id]
    return torch.tensor(ids, dtype=torch.long), starts


def train(
    cfg: dict[str, Any],
    docs: Sequence[str],
    *,
    steps: int,
    batch_size: int = 16,
    seq_len: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 0,
) -> dict[str, torch.Tensor]:
    """AdamW with warmup and cosine decay; windows start at a document's BOS, so the model
    sees BOS at position 0 as it will at inference; returns detached fp32 tensors."""
    # Restored on return: the flag is process-wide, and a caller (a test session) may
    # run ops that have no deterministic implementation.
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _train(cfg, docs, steps, batch_size, seq_len, lr, seed, log_every)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _train(
    cfg: dict[str, Any],
    docs: Sequence[str],
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    seed: int,
    log_every: int,
) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    stream, starts = token_stream(docs)
    starts = [s for s in starts if s + seq_len + 1 <= len(stream)]
    if not starts:
        raise ValueError(f"corpus too small for seq_len {seq_len}")
    r = random.Random(seed)
    params = init_params(cfg, seed)
    opt = _optimizer(params, lr)
    warmup = max(1, steps // 20)
    offsets = torch.arange(seq_len + 1)
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * max(_lr_scale(step, steps, warmup), 0.05)
        batch = torch.tensor([r.choice(starts) for _ in range(batch_size)])
        window = stream[batch[:, None] + offsets[None, :]]
        logits = forward(params, cfg, window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            elapsed = time.perf_counter() - t0
            print(f"step {step:5d}  loss {loss.item():.3f}  {elapsed:6.1f} s", flush=True)
    return {n: t.detach().clone().contiguous() for n, t in params.items()}


def _optimizer(params: dict[str, torch.Tensor], lr: float) -> torch.optim.AdamW:
    """AdamW; weight decay on the matrices only (not on norms' gains)."""
    decay = [t for n, t in params.items() if t.dim() == 2]
    no_decay = [t for n, t in params.items() if t.dim() != 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def _lr_scale(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def save(out_dir: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m refserve.model.train_tiny", description=__doc__)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus-bytes", type=int, default=150_000)
    ap.add_argument("--out", type=Path, default=TRAINED_DIR)
    args = ap.parse_args(argv)
    # One thread: multithreaded CPU matmuls may split sums differently from run to run.
    torch.set_num_threads(1)
    cfg = hf_config()
    docs = documents(args.seed, args.corpus_bytes)
    t0 = time.perf_counter()
    tensors = train(
        cfg,
        docs,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        log_every=100,
    )
    save(args.out, cfg, tensors)
    n = sum(t.numel() for t in tensors.values())
    print(f"{n} parameters, trained in {time.perf_counter() - t0:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
