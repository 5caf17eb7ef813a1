"""Dense kernels with the attention surface beyond our kernel (docs/KERNELS.md, "Beyond
our kernel"), to check the grid's oracle-only cases end to end.

:func:`reference_extended` declares every feature and computes each case correctly (it
wraps ``refserve.kernels.oracle.paged_attention_extended_f64`` and rounds to the query's dtype);
the others are it with one classic bug: ALiBi with the sign flipped, sinks dropped from
the denominator, the fp8 scales ignored, and the log-sum-exp returned in base 2.
"""

from __future__ import annotations

from typing import Any

import torch

from refserve.kernels.oracle import paged_attention_extended_f64

ALL_FEATURES = ["non_causal", "alibi", "sinks", "fp8_kv", "v_head_size", "per_request_window",
                "lse"]  # fmt: skip


def _run(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | torch.Tensor | None = None,
    softcap: float | None = None,
    causal: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    return_lse: bool = False,
    bug: str = "",
) -> Any:
    window = sliding_window.tolist() if isinstance(sliding_window, torch.Tensor) else sliding_window
    out, lse = paged_attention_extended_f64(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale=scale, sliding_window=window, softcap=softcap, causal=causal,
        alibi_slopes=None if alibi_slopes is None else (
            -alibi_slopes if bug == "alibi_sign" else alibi_slopes),
        sinks=None if bug == "sinks" else sinks,
        k_scale=1.0 if bug == "scales" else k_scale,
        v_scale=1.0 if bug == "scales" else v_scale,
    )  # fmt: skip
    out = out.to(query.dtype).to(query.device)
    if not return_lse:
        return out
    if bug == "lse_base2":
        lse = lse / torch.log(torch.tensor(2.0, dtype=lse.dtype))
    return out, lse.float().to(query.device)


def reference_extended(*args: Any, **kwargs: Any) -> Any:
    """Correct on every case (a dense float64 computation rounded to the query dtype)."""
    return _run(*args, **kwargs)


def alibi_sign_flipped(*args: Any, **kwargs: Any) -> Any:
    """Bug: adds ``slope * (q_pos - k_pos)`` (favours far keys)."""
    return _run(*args, **kwargs, bug="alibi_sign")


def sinks_dropped(*args: Any, **kwargs: Any) -> Any:
    """Bug: ignores the attention-sink logits."""
    return _run(*args, **kwargs, bug="sinks")


def ignores_kv_scales(*args: Any, **kwargs: Any) -> Any:
    """Bug: reads fp8 K/V without multiplying by k_scale / v_scale."""
    return _run(*args, **kwargs, bug="scales")


def lse_base2(*args: Any, **kwargs: Any) -> Any:
    """Bug: returns the log-sum-exp in base 2 (a FlashInfer-style convention) as natural."""
    return _run(*args, **kwargs, bug="lse_base2")


for _fn in (reference_extended, alibi_sign_flipped, sinks_dropped, ignores_kv_scales, lse_base2):
    # Declared as capabilities (docs/KERNELS.md): every feature and both knobs of the grid.
    _fn.__dict__["refserve_capabilities"] = {"features": ALL_FEATURES}
