"""A Llama-architecture decoder, one forward per step over the flattened tokens.

RMSNorm, rotary embeddings (rotate-half convention, base ``rope_theta``), grouped-query
attention through the paged KV cache, SwiGLU MLP, tied or untied LM head. The math
follows Hugging Face ``LlamaForCausalLM`` operation by operation (RMSNorm in fp32, RoPE
frequencies in fp32), so that fp32 logits agree to rounding.

The tokens of every scheduled request (prefill chunks and decodes) are concatenated;
each layer writes this step's K/V into the caches at ``slot_mapping`` and then attends
through the block tables, so a token sees the K/V of earlier steps, of prefix-cache
hits, and of earlier tokens of its own chunk alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ref.kv import BlockCopy
from ref.model.attention import AttentionBackend, AttentionMetadata, default_scale
from ref.model.config import ModelConfig
from ref.model.weights import LayerWeights, LlamaWeights


class KVCache:
    """Per-layer key and value caches, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key, *self.value))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[T, head_dim]`` for the rotate-half convention."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]``; ``cos``/``sin`` ``[T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: LlamaWeights, backend: AttentionBackend) -> None:
        self.config = cfg
        self.weights = weights
        self.backend = backend
        self.scale = default_scale(cfg.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        copies: tuple[BlockCopy, ...] = (),
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm.

        ``copies`` (copy-on-write) are applied to every layer's caches before any K/V of
        this step is written.
        """
        cfg = self.config
        for layer in range(cfg.num_layers):
            self.backend.copy_blocks(cache.key[layer], cache.value[layer], copies)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, self.dtype)
        h = F.embedding(input_ids, self.weights.embed)
        for i, lw in enumerate(self.weights.layers):
            h = h + self._attention(
                lw, rms_norm(h, lw.input_norm, cfg.rms_norm_eps), cos, sin, meta, cache, i
            )
            h = h + self._mlp(lw, rms_norm(h, lw.post_norm, cfg.rms_norm_eps))
        return rms_norm(h, self.weights.norm, cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of the given hidden rows."""
        return F.linear(hidden, self.weights.lm_head).float()

    def _attention(
        self,
        lw: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        cfg = self.config
        t = x.shape[0]
        q = F.linear(x, lw.q_proj, lw.q_bias).view(t, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, lw.k_proj, lw.k_bias).view(t, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, lw.v_proj, lw.v_bias).view(t, cfg.num_kv_heads, cfg.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        kc, vc = cache.key[layer], cache.value[layer]
        self.backend.write_kv(k, v, kc, vc, meta)
        o = self.backend.attend(q, kc, vc, meta, self.scale)
        return F.linear(o.reshape(t, cfg.num_heads * cfg.head_dim), lw.o_proj)

    def _mlp(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj), lw.down_proj)
