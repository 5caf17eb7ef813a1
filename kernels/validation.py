"""Input checks shared by the dense oracle and the Triton entry points.

docs/ARCHITECTURE.md ("Kernels") fixes one vLLM-style layout for every kernel in this package:

- ``query`` ``[T, Hq, D]``: this step's query tokens of all sequences, packed;
- ``key_cache`` / ``value_cache`` ``[num_blocks, block_size, Hkv, D]``;
- ``block_table`` int32 ``[S, max_blocks]``: physical block of each logical block;
- ``seq_lens`` int32 ``[S]``: KV length of each sequence, *including* this step's tokens;
- ``query_start_loc`` int32 ``[S + 1]``: sequence ``s`` owns query rows
  ``query_start_loc[s] : query_start_loc[s + 1]``.

Both the oracle and the Triton kernels call the functions here, so a caller gets the same
:class:`KernelInputError` (naming the argument and the shapes seen) from either. Checks
come in two kinds: *shape* checks read only tensor metadata and are free; *value* checks
(``check_values=True``) read the index tensors on the host, which costs a device sync,
so a hot path may turn them off once its inputs are trusted.

This module needs only torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

#: Data types the kernels and the oracle accept for queries and caches.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


class KernelInputError(ValueError):
    """An argument of a kernel entry point has the wrong shape, dtype, device or value.

    ``argument`` is the parameter's name; the message repeats it together with the
    shapes and dtypes that were seen, so the error can be read without the code open.
    """

    def __init__(self, function: str, argument: str, message: str) -> None:
        super().__init__(f"{function}: argument {argument!r}: {message}")
        self.function = function
        self.argument = argument


@dataclass(frozen=True)
class AttentionDims:
    """Sizes read off validated ``paged_attention`` inputs."""

    num_tokens: int
    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA); query head ``h`` reads KV head ``h // group_size``."""
        return self.num_q_heads // self.num_kv_heads


def _describe(t: torch.Tensor) -> str:
    return f"shape={tuple(t.shape)} dtype={t.dtype} device={t.device}"


def _require(cond: bool, function: str, argument: str, message: str) -> None:
    if not cond:
        raise KernelInputError(function, argument, message)


def _require_tensor(value: object, function: str, argument: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise KernelInputError(function, argument, f"expected a torch.Tensor, got {type(value)}")
    return value


def _require_index(
    t: torch.Tensor, function: str, argument: str, shape: str, dtypes: tuple[torch.dtype, ...]
) -> None:
    _require(
        t.dtype in dtypes,
        function,
        argument,
        f"must have dtype {' or '.join(str(d) for d in dtypes)} and shape {shape}; "
        f"got {_describe(t)}",
    )


def validate_paged_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
    check_values: bool = True,
    function: str = "paged_attention",
) -> AttentionDims:
    """Check ``paged_attention`` arguments (layout in the module docstring); return sizes.

    Value checks (``check_values``): ``query_start_loc`` starts at 0, ends at ``T`` and
    never decreases; each sequence has ``1 <= q_len <= seq_len`` or ``q_len == 0`` (a
    sequence with no query this step); ``seq_len`` fits in the block table; every block
    table entry a sequence *uses* (``ceil(seq_len / block_size)`` of them) names a real
    block. Entries past that are never read and may hold anything (e.g. ``-1``).
    """
    f = function
    names = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")
    args = (query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    for name, arg in zip(names, args, strict=True):
        _require_tensor(arg, f, name)

    _require(query.dim() == 3, f, "query", f"must be [T, Hq, D]; got {_describe(query)}")
    _require(
        key_cache.dim() == 4,
        f,
        "key_cache",
        f"must be [num_blocks, block_size, Hkv, D]; got {_describe(key_cache)}",
    )
    _require(
        value_cache.shape == key_cache.shape,
        f,
        "value_cache",
        f"must have key_cache's shape {tuple(key_cache.shape)}; got {_describe(value_cache)}",
    )
    _require(
        query.dtype in SUPPORTED_DTYPES,
        f,
        "query",
        f"dtype must be one of {SUPPORTED_DTYPES}; got {_describe(query)}",
    )
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _require(
            cache.dtype == query.dtype,
            f,
            name,
            f"must have query's dtype {query.dtype}; got {_describe(cache)}",
        )
    num_tokens, num_q_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_size = key_cache.shape
    _require(
        cache_head_size == head_size,
        f,
        "key_cache",
        f"head size {cache_head_size} differs from query's {head_size} "
        f"(query {tuple(query.shape)}, key_cache {tuple(key_cache.shape)})",
    )
    _require(head_size >= 1, f, "query", f"head size must be >= 1; got {_describe(query)}")
    _require(
        block_size >= 1, f, "key_cache", f"block_size must be >= 1; got {_describe(key_cache)}"
    )
    _require(
        num_kv_heads >= 1 and num_q_heads % num_kv_heads == 0,
        f,
        "key_cache",
        f"query heads ({num_q_heads}) must be a positive multiple of KV heads ({num_kv_heads})",
    )

    _require(
        block_table.dim() == 2,
        f,
        "block_table",
        f"must be int32 [S, max_blocks]; got {_describe(block_table)}",
    )
    _require_index(block_table, f, "block_table", "[S, max_blocks]", (torch.int32,))
    num_seqs = block_table.shape[0]
    _require(
        seq_lens.shape == (num_seqs,),
        f,
        "seq_lens",
        f"must be int32 [S] with S={num_seqs} (block_table rows); got {_describe(seq_lens)}",
    )
    _require_index(seq_lens, f, "seq_lens", f"[{num_seqs}]", (torch.int32,))
    _require(
        query_start_loc.shape == (num_seqs + 1,),
        f,
        "query_start_loc",
        f"must be int32 [S + 1] with S={num_seqs}; got {_describe(query_start_loc)}",
    )
    _require_index(query_start_loc, f, "query_start_loc", f"[{num_seqs + 1}]", (torch.int32,))
    for name, arg in zip(names[1:], args[1:], strict=True):
        _require(
            arg.device == query.device,
            f,
            name,
            f"must be on query's device {query.device}; got {_describe(arg)}",
        )

    if scale is not None:
        _require(
            isinstance(scale, int | float) and scale == scale and abs(scale) != float("inf"),
            f,
            "scale",
            f"must be a finite number or None; got {scale!r}",
        )
    if sliding_window is not None:
        _require(
            isinstance(sliding_window, int) and sliding_window >= 1,
            f,
            "sliding_window",
            f"must be an int >= 1 or None; got {sliding_window!r}",
        )
    if softcap is not None:
        _require(
            isinstance(softcap, int | float) and softcap > 0 and softcap != float("inf"),
            f,
            "softcap",
            f"must be a finite number > 0 or None; got {softcap!r}",
        )

    dims = AttentionDims(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        num_blocks=num_blocks,
        block_size=block_size,
        max_blocks_per_seq=block_table.shape[1],
    )
    if check_values:
        _check_attention_values(dims, block_table, seq_lens, query_start_loc, f)
    return dims


def _check_attention_values(
    dims: AttentionDims,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    f: str,
) -> None:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    _require(
        starts[0] == 0 and starts[-1] == dims.num_tokens,
        f,
        "query_start_loc",
        f"must start at 0 and end at T={dims.num_tokens}; got {starts}",
    )
    _require(
        all(a <= b for a, b in itertools.pairwise(starts)),
        f,
        "query_start_loc",
        f"must never decrease; got {starts}",
    )
    table = block_table.cpu()
    capacity = dims.max_blocks_per_seq * dims.block_size
    for s in range(dims.num_seqs):
        q_len = starts[s + 1] - starts[s]
        _require(
            q_len <= lens[s] <= capacity,
            f,
            "seq_lens",
            f"sequence {s} has seq_len {lens[s]} but needs q_len ({q_len}) <= seq_len <= "
            f"max_blocks * block_size ({capacity})",
        )
        used = table[s, : -(-lens[s] // dims.block_size)]
        bad = used[(used < 0) | (used >= dims.num_blocks)]
        _require(
            bad.numel() == 0,
            f,
            "block_table",
            f"sequence {s} uses block ids {bad.tolist()} outside [0, {dims.num_blocks})",
        )


def validate_write_kv_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
    function: str = "write_kv",
) -> None:
    """Check ``write_kv`` arguments: ``key``/``value`` ``[T, Hkv, D]`` go to ``slot_mapping``.

    ``slot_mapping`` is int32 or int64 ``[T]``; slot ``p`` is block ``p // block_size``,
    offset ``p % block_size`` (docs/ARCHITECTURE.md "Vocabulary"); ``-1`` means skip the token. With
    ``check_values``, every other slot must lie in ``[0, num_blocks * block_size)`` and no
    slot may be written twice (the result would depend on the order of writes).
    """
    f = function
    for name, arg in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
    ):
        _require_tensor(arg, f, name)
    _require(key.dim() == 3, f, "key", f"must be [T, Hkv, D]; got {_describe(key)}")
    _require(
        value.shape == key.shape and value.dtype == key.dtype,
        f,
        "value",
        f"must match key ({_describe(key)}); got {_describe(value)}",
    )
    _require(
        key_cache.dim() == 4,
        f,
        "key_cache",
        f"must be [num_blocks, block_size, Hkv, D]; got {_describe(key_cache)}",
    )
    _require(
        value_cache.shape == key_cache.shape,
        f,
        "value_cache",
        f"must have key_cache's shape {tuple(key_cache.shape)}; got {_describe(value_cache)}",
    )
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _require(
            cache.dtype == key.dtype,
            f,
            name,
            f"must have key's dtype {key.dtype}; got {_describe(cache)}",
        )
    _require(
        key_cache.shape[2:] == key.shape[1:],
        f,
        "key_cache",
        f"[Hkv, D] {tuple(key_cache.shape[2:])} differs from key's {tuple(key.shape[1:])}",
    )
    _require(
        slot_mapping.shape == (key.shape[0],),
        f,
        "slot_mapping",
        f"must be [T] with T={key.shape[0]}; got {_describe(slot_mapping)}",
    )
    _require_index(slot_mapping, f, "slot_mapping", "[T]", (torch.int32, torch.int64))
    for name, arg in (
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
    ):
        _require(
            arg.device == key.device,
            f,
            name,
            f"must be on key's device {key.device}; got {_describe(arg)}",
        )
    if check_values:
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        slots = slot_mapping.cpu()
        live = slots[slots != -1]
        bad = live[(live < 0) | (live >= num_slots)]
        _require(
            bad.numel() == 0,
            f,
            "slot_mapping",
            f"slots {bad.tolist()} are neither -1 nor in [0, {num_slots})",
        )
        _require(
            len(set(live.tolist())) == live.numel(),
            f,
            "slot_mapping",
            "a slot appears twice; the cache contents would depend on write order",
        )


def validate_copy_blocks_inputs(
    src_key_cache: torch.Tensor,
    src_value_cache: torch.Tensor,
    dst_key_cache: torch.Tensor,
    dst_value_cache: torch.Tensor,
    block_mapping: torch.Tensor,
    *,
    check_values: bool = True,
    function: str = "copy_blocks",
) -> None:
    """Check ``copy_blocks`` arguments; ``block_mapping`` int64 ``[N, 2]`` holds (src, dst).

    Source and destination pools may be the same tensors (copy-on-write) or different ones,
    possibly on different devices (swap). All four caches share one ``[block_size, Hkv, D]``
    block shape and one dtype; each pair's key and value caches share a device. With
    ``check_values``: ids lie inside their pools, destinations are distinct, and within
    one pool no destination is also a source (the result would depend on copy order).
    """
    f = function
    caches = (
        ("src_key_cache", src_key_cache),
        ("src_value_cache", src_value_cache),
        ("dst_key_cache", dst_key_cache),
        ("dst_value_cache", dst_value_cache),
    )
    for name, arg in (*caches, ("block_mapping", block_mapping)):
        _require_tensor(arg, f, name)
    for name, cache in caches:
        _require(
            cache.dim() == 4,
            f,
            name,
            f"must be [num_blocks, block_size, Hkv, D]; got {_describe(cache)}",
        )
        _require(
            cache.shape[1:] == src_key_cache.shape[1:] and cache.dtype == src_key_cache.dtype,
            f,
            name,
            f"block shape and dtype must match src_key_cache ({_describe(src_key_cache)}); "
            f"got {_describe(cache)}",
        )
    _require(
        src_value_cache.shape[0] == src_key_cache.shape[0]
        and src_value_cache.device == src_key_cache.device,
        f,
        "src_value_cache",
        f"must match src_key_cache's blocks and device; got {_describe(src_value_cache)}",
    )
    _require(
        dst_value_cache.shape[0] == dst_key_cache.shape[0]
        and dst_value_cache.device == dst_key_cache.device,
        f,
        "dst_value_cache",
        f"must match dst_key_cache's blocks and device; got {_describe(dst_value_cache)}",
    )
    _require(
        block_mapping.dim() == 2 and block_mapping.shape[1] == 2,
        f,
        "block_mapping",
        f"must be int64 [N, 2] of (src, dst) pairs; got {_describe(block_mapping)}",
    )
    _require_index(block_mapping, f, "block_mapping", "[N, 2]", (torch.int64,))
    if check_values and block_mapping.numel() > 0:
        pairs = block_mapping.cpu()
        src, dst = pairs[:, 0], pairs[:, 1]
        for name, ids, pool in (("src", src, src_key_cache), ("dst", dst, dst_key_cache)):
            bad = ids[(ids < 0) | (ids >= pool.shape[0])]
            _require(
                bad.numel() == 0,
                f,
                "block_mapping",
                f"{name} block ids {bad.tolist()} outside [0, {pool.shape[0]})",
            )
        _require(
            len(set(dst.tolist())) == dst.numel(),
            f,
            "block_mapping",
            f"destination blocks must be distinct; got {dst.tolist()}",
        )
        same_pool = (
            src_key_cache.data_ptr() == dst_key_cache.data_ptr()
            or src_value_cache.data_ptr() == dst_value_cache.data_ptr()
        )
        if same_pool:
            chained = sorted(set(src.tolist()) & set(dst.tolist()))
            _require(
                not chained,
                f,
                "block_mapping",
                f"blocks {chained} are both a source and a destination in one pool",
            )
