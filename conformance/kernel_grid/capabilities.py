"""What a kernel under test declares it supports (docs/KERNELS.md, "Capabilities"), and
why a case falls outside that (``NOT_SUPPORTED``, never a failure)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from refserve.conformance.kernel_grid.cases import LAYOUTS, GridCase


class GridHarnessError(RuntimeError):
    """The grid itself could not run (worker would not start, bad capabilities): exit 2."""


_DTYPE_NAMES = ("float32", "float16", "bfloat16")


#: Attention features beyond our kernel's that a kernel may declare (docs/KERNELS.md).
FEATURES = ("non_causal", "alibi", "sinks", "fp8_kv", "v_head_size", "per_request_window", "lse")


@dataclass(frozen=True)
class KernelCapabilities:
    """What a kernel under test supports (docs/KERNELS.md, "Capabilities").

    Declare it as ``fn.refserve_capabilities = {...}`` (a dict of these fields, so a
    kernel need not import refserve) or as an instance. ``None`` means "any" for the
    sets. ``split_kv`` ``None``: detected from a ``num_kv_splits`` keyword.
    """

    decode_only: bool = False
    sliding_window: bool = True
    softcap: bool = True
    dtypes: frozenset[str] | None = None
    block_sizes: frozenset[int] | None = None
    head_sizes: frozenset[int] | None = None
    layouts: frozenset[str] = frozenset({"nhd"})
    noncontiguous_kv: bool = True
    split_kv: bool | None = None
    features: frozenset[str] = frozenset()

    @classmethod
    def from_declared(cls, declared: object) -> KernelCapabilities:
        """Parse a declaration; raise :class:`GridHarnessError` naming a bad field."""
        if declared is None:
            return cls()
        if isinstance(declared, KernelCapabilities):
            return declared
        if not isinstance(declared, Mapping):
            raise GridHarnessError(
                f"refserve_capabilities must be a dict or KernelCapabilities; got "
                f"{type(declared).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(map(str, declared)) - known)
        if unknown:
            raise GridHarnessError(
                f"refserve_capabilities: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        kw: dict[str, Any] = {}
        for name, value in declared.items():
            if name in ("dtypes", "block_sizes", "head_sizes", "layouts", "features") and (
                value is not None
            ):
                value = frozenset(str(v).removeprefix("torch.") if name == "dtypes" else v
                                  for v in value)  # fmt: skip
            kw[str(name)] = value
        caps = cls(**kw)
        if caps.layouts - set(LAYOUTS):
            raise GridHarnessError(f"refserve_capabilities: layouts must be within {LAYOUTS}")
        if caps.features - set(FEATURES):
            raise GridHarnessError(f"refserve_capabilities: features must be within {FEATURES}")
        if caps.dtypes is not None and caps.dtypes - set(_DTYPE_NAMES):
            raise GridHarnessError(f"refserve_capabilities: dtypes must be within {_DTYPE_NAMES}")
        return caps

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = sorted(value) if isinstance(value, frozenset) else value
        return out


def capabilities_of(fn: Callable[..., Any]) -> KernelCapabilities:
    """``fn``'s declared capabilities, with ``split_kv`` resolved from its signature."""
    caps = KernelCapabilities.from_declared(getattr(fn, "refserve_capabilities", None))
    if caps.split_kv is None:
        # Only a named keyword: a **kwargs wrapper may not mean split-KV by it.
        caps = replace(caps, split_kv="num_kv_splits" in signature_names(fn))
    return caps


def unsupported_reason(case: GridCase, dtype: str, caps: KernelCapabilities) -> str | None:
    """Why ``caps`` excludes ``case`` at ``dtype`` (the NOT_SUPPORTED reason), or None.

    The first reason in this order: the kernel's options, the sizes and the layout, then
    the caches' view, split-KV and the features beyond our kernel's.
    """
    return (
        _option_gap(case, caps)
        or _outside("dtype", dtype, caps.dtypes)
        or _outside("block size", case.block_size, caps.block_sizes)
        or _outside("head size", case.head_size, caps.head_sizes)
        or _outside("layout", case.layout, caps.layouts)
        or _surface_gap(case, caps)
    )


def _option_gap(case: GridCase, caps: KernelCapabilities) -> str | None:
    """A prefill on a decode-only kernel, or an option (window, softcap) it lacks."""
    if caps.decode_only and case.op == "paged_attention" and not case.decode_only:
        return "decode-only kernel; case has prefill/chunk queries"
    if case.sliding_window is not None and not caps.sliding_window:
        return "no sliding window"
    if case.softcap is not None and not caps.softcap:
        return "no softcap"
    return None


def _outside(
    what: str, value: str | int, allowed: frozenset[str] | frozenset[int] | None
) -> str | None:
    """``value`` is not among the declared ``allowed`` ones (None: any is)."""
    if allowed is None or value in allowed:
        return None
    return f"{what} {value} not in {sorted(allowed)}"


def _surface_gap(case: GridCase, caps: KernelCapabilities) -> str | None:
    """Non-contiguous caches, split-KV or extended features the kernel does not take."""
    if case.kv_view != "contiguous" and not caps.noncontiguous_kv:
        return "needs contiguous K/V caches"
    if case.num_kv_splits is not None and not caps.split_kv:
        return "no split-KV (no num_kv_splits keyword)"
    missing = case.features - caps.features
    if missing:
        return f"feature(s) {sorted(missing)} not declared"
    return None


def signature_names(fn: Callable[..., Any]) -> set[str]:
    """``fn``'s parameter names (none when it has no signature to read)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()
