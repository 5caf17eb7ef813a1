"""Mutants of our Triton kernel: realistic tiling bugs the default grid must catch.

Each :class:`Mutant` is one source patch of ``kernels/attention.py`` (docs/KERNELS.md,
"Mutants"), the kind of bug planted in copies of vLLM's unified attention when the grid
was designed: an online-softmax rescale without the ``-inf`` guard, window tile pruning
off by one, a split-KV segment count rounded down, a merge that forgets to rescale, a
query tile reading past its sequence, a window one key too wide, softcap before scale,
and GQA heads mapped the wrong way round. ``caught_by`` lists the default-grid cases that
catch it in the interpreter (key tiles of 32); ``test_kernels_mutants.py`` runs exactly
those and checks that they are in the default grid.

The patched module is written to a temporary directory and imported from there (Triton's
``@triton.jit`` reads a kernel's source from its file). ``MODULE:FUNCTION`` targets work
too: ``mutant_kernels:unguarded_rescale`` resolves through :func:`__getattr__`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "attention.py"


@dataclass(frozen=True)
class Mutant:
    """Replace ``old`` (which must occur exactly once) by ``new`` in kernels/attention.py."""

    name: str
    old: str
    new: str
    why: str
    caught_by: tuple[str, ...]
    # Reads out of bounds: in the interpreter it may segfault, so it runs isolated.
    may_crash: bool = False


# The softcap lines of the kernel's inner loop, as indented there.
_CAP = "        if USE_SOFTCAP:\n            s = softcap * _tanh(s / softcap)"

MUTANTS: MappingProxyType[str, Mutant] = MappingProxyType(
    {
        m.name: m
        for m in (
            Mutant(
                "unguarded_rescale",
                'm_shift = tl.where(m_new == float("-inf"), 0.0, m_new)',
                "m_shift = m_new",
                "exp(-inf - -inf) = NaN for a row whose window has not started in this tile",
                ("tile32_small_window_cross",),
            ),
            Mutant(
                "window_prune_off_by_one",
                "context_len + q_tile * BLOCK_Q - sliding_window + 1, 0)",
                "context_len + q_tile * BLOCK_Q - sliding_window + 2, 0)",
                "skips the key tile holding the first visible key when it is a tile's last",
                ("tile32_window_edge_m1",),
            ),
            Mutant(
                "split_floor_segments",
                "tiles_per_segment = tl.cdiv(tile_hi - tile_lo, NUM_SEGMENTS)",
                "tiles_per_segment = (tile_hi - tile_lo) // NUM_SEGMENTS",
                "segments that do not divide the key tiles drop the last ones",
                ("split3_bs5_plain",),
            ),
            Mutant(
                "merge_unscaled_sum",
                "den = tl.sum(l_s * w, 0)",
                "den = tl.sum(l_s, 0)",
                "the split-KV merge adds segment sums taken under different maxima",
                ("split3_bs5_plain",),
            ),
            Mutant(
                "query_tile_reads_past_end",
                "last_q_pos = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1",
                "last_q_pos = context_len + (q_tile + 1) * BLOCK_Q - 1",
                "a sequence's last, partial query tile reads keys past seq_len (NaN poison)",
                ("tile32_q_cross",),
                may_crash=True,
            ),
            Mutant(
                "window_one_too_wide",
                "visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)",
                "visible = visible & (k_pos[None, :] >= q_pos[:, None] - sliding_window)",
                "a query sees w + 1 keys",
                ("sliding_window_7",),
            ),
            Mutant(
                "softcap_before_scale",
                "s = s * scale\n" + _CAP,
                _CAP.lstrip() + "\n        s = s * scale",
                "tanh capping applied to unscaled scores",
                ("softcap_5",),
            ),
            Mutant(
                "gqa_heads_interleaved",
                "head = kv_head * GROUP + rows % GROUP",
                "head = kv_head + (rows % GROUP) * tl.num_programs(1)",
                "query head h read KV head h % Hkv instead of h // group",
                ("mixed_batch",),
            ),
        )
    }
)


def mutated_source(mutant: Mutant) -> str:
    """kernels/attention.py with the mutant's patch applied (exactly one occurrence)."""
    text = SOURCE.read_text(encoding="utf-8")
    count = text.count(mutant.old)
    if count != 1:
        raise AssertionError(f"mutant {mutant.name}: patch site found {count} times")
    return text.replace(mutant.old, mutant.new)


def load(name: str) -> ModuleType:
    """Import the mutant's module (cached in sys.modules; rewritten if the source moved)."""
    mutant = MUTANTS[name]
    source = mutated_source(mutant)
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    module_name = f"refserve_mutant_{name}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    folder = Path(tempfile.gettempdir()) / "refserve-kernel-mutants"
    folder.mkdir(exist_ok=True)
    path = folder / f"{module_name}.py"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(source, encoding="utf-8")
        tmp.replace(path)  # atomic: parallel workers never import half a file
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def __getattr__(name: str) -> Callable[..., Any]:
    if name not in MUTANTS:
        raise AttributeError(f"module 'mutant_kernels' has no attribute {name!r}")
    fn: Callable[..., Any] = load(name).paged_attention
    return fn
