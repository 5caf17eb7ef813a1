"""A Llama-architecture decoder, one forward per step over the flattened tokens.

RMSNorm, rotary embeddings (rotate-half convention, base ``rope_theta``), grouped-query
attention through the paged KV cache (each layer full or, in a hybrid model such as a
Qwen2 with ``layer_types``, within its sliding window), SwiGLU MLP, tied or untied LM head. The math
follows Hugging Face ``LlamaForCausalLM`` operation by operation (RMSNorm in fp32, RoPE
frequencies in fp32), so that fp32 logits agree to rounding.

The tokens of every scheduled request (prefill chunks and decodes) are concatenated;
each layer writes this step's K/V into the caches at ``slot_mapping`` and then attends
through the block tables, so a token sees the K/V of earlier steps, of prefix-cache
hits, and of earlier tokens of its own chunk alike.

:class:`HostKVCache` is the host side of preemption by swap: the same per-block shape
on the CPU, filled and read back by whole-block copies that the executor applies before
the forward (swap-outs, then swap-ins, then copy-on-write; see ``StepPlan``).

On a grouped KV pool (a hybrid model's full and window layer groups, ref/kv/groups.py)
each layer group has its own block tables and slots: :meth:`LlamaModel.forward` takes
the first group's metadata and, in ``groups``, the others'; a layer reads and writes
through its group's (``refserve.model.config.layer_groups``). Every layer still has a
cache of all ``num_blocks`` blocks. That is correct because the groups share one
allocator: a block id belongs to one group's tables at a time, so only that group's
layers write it while it is held, and they write every slot before any query reads it
(a prefix hit is a block its own group computed: the cache keys are per group, and a
block's entry is dropped when any group reuses it). The other layers' bytes of that
block are never read. It costs each layer the whole pool; a production engine sizes the
pool per group and lets groups of equal layer count share the same bytes (vLLM's
hybrid KV cache manager), which changes where a block lives, not what is read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from refserve.errors import InvalidArgument
from refserve.kv import BlockCopy
from refserve.model.attention import AttentionBackend, AttentionMetadata, default_scale
from refserve.model.config import ModelConfig, kv_groups, layer_groups
from refserve.model.weights import LayerWeights, LlamaWeights
from refserve.values import is_int


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

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over every layer: what one swap copy moves."""
        return self.nbytes // self.num_blocks if self.num_blocks else 0

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer (what the swap cost rule prices)."""
        per_slot = self.key[0].shape[2] * self.key[0].shape[3] if self.key else 0
        return sum(per_slot * t.element_size() for t in (*self.key, *self.value))


class HostKVCache:
    """The host side of swap (ref/kv/host_pool.py): ``num_blocks`` blocks of K and V per
    layer on the CPU, each block shaped like a device block so a swap is whole-block
    indexed copies.

    Pinned (page-locked) only when the device cache is on CUDA: pinned memory is what
    lets the host <-> device copies run at link speed there, and on a CPU-only build it
    is meaningless (and ``pin_memory`` raises without a CUDA runtime).
    """

    def __init__(self, device_cache: KVCache, num_blocks: int) -> None:
        if not is_int(num_blocks) or num_blocks < 0:
            raise InvalidArgument(f"num_host_blocks must be an int >= 0, got {num_blocks!r}")
        ref = device_cache.key[0] if device_cache.key else None
        per_block: tuple[int, ...] = tuple(ref.shape[1:]) if ref is not None else ()
        dtype = ref.dtype if ref is not None else torch.float32
        pin = ref is not None and ref.device.type == "cuda"
        shape = (num_blocks, *per_block)
        layers = len(device_cache.key)
        self.key = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(layers)]
        self.value = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(layers)]
        self.num_blocks = num_blocks
        self.block_size = device_cache.block_size
        self.pinned = pin

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key, *self.value))

    def swap_out(self, cache: KVCache, copies: Sequence[BlockCopy]) -> int:
        """Device block ``c.src`` -> host block ``c.dst`` for every copy, every layer.

        Returns the bytes moved (K and V, all layers)."""
        return _copy_between(cache.key, cache.value, self.key, self.value, copies)

    def swap_in(self, cache: KVCache, copies: Sequence[BlockCopy]) -> int:
        """Host block ``c.src`` -> device block ``c.dst`` for every copy, every layer."""
        return _copy_between(self.key, self.value, cache.key, cache.value, copies)


def _copy_between(
    src_key: Sequence[torch.Tensor],
    src_value: Sequence[torch.Tensor],
    dst_key: Sequence[torch.Tensor],
    dst_value: Sequence[torch.Tensor],
    copies: Sequence[BlockCopy],
) -> int:
    """Whole-block copies between two caches (possibly on different devices).

    Every index is checked before the first write, so a bad copy list raises
    :class:`InvalidArgument` with both caches untouched. Within one list the sources
    are read before any destination is written (gather, then scatter), so the result
    does not depend on the order of the copies.
    """
    if not copies or not src_key:
        return 0
    n_src, n_dst = src_key[0].shape[0], dst_key[0].shape[0]
    if len({c.dst for c in copies}) != len(copies):
        raise InvalidArgument("block copies write the same destination block twice")
    for c in copies:
        if not (0 <= c.src < n_src and 0 <= c.dst < n_dst):
            raise InvalidArgument(
                f"block copy {c.src} -> {c.dst} is outside the caches ({n_src} -> {n_dst} blocks)"
            )
    src_idx = torch.tensor([c.src for c in copies], dtype=torch.int64, device=src_key[0].device)
    dst_idx = torch.tensor([c.dst for c in copies], dtype=torch.int64, device=dst_key[0].device)
    moved = 0
    for src, dst in ((src_key, dst_key), (src_value, dst_value)):
        for s, d in zip(src, dst, strict=True):
            rows = s.index_select(0, src_idx).to(d.device)
            d.index_copy_(0, dst_idx, rows)
            moved += rows.numel() * rows.element_size()
    return moved


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
        self.layer_groups = layer_groups(cfg)
        self.num_kv_groups = len(kv_groups(cfg))

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
        groups: Sequence[AttentionMetadata] = (),
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm.

        ``copies`` (copy-on-write) are applied to every layer's caches before any K/V of
        this step is written: a copy's destination is a block just given to one group,
        which no other group's table holds, so the copy is harmless in other layers.
        ``groups``: on a grouped pool, the metadata of layer groups 1.. (module doc);
        empty, every layer reads ``meta``.
        """
        cfg = self.config
        if groups and len(groups) != self.num_kv_groups - 1:
            raise InvalidArgument(
                f"forward: metadata for {len(groups) + 1} layer groups, the model has "
                f"{self.num_kv_groups}"
            )
        metas = (meta, *groups)
        for layer in range(cfg.num_layers):
            self.backend.copy_blocks(cache.key[layer], cache.value[layer], copies)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, self.dtype)
        h = F.embedding(input_ids, self.weights.embed)
        for i, lw in enumerate(self.weights.layers):
            m = metas[self.layer_groups[i]] if groups else meta
            h = h + self._attention(
                lw, rms_norm(h, lw.input_norm, cfg.rms_norm_eps), cos, sin, m, cache, i
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
        o = self.backend.attend(q, kc, vc, meta, self.scale, cfg.layer_window(layer))
        return F.linear(o.reshape(t, cfg.num_heads * cfg.head_dim), lw.o_proj)

    def _mlp(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj), lw.down_proj)
