"""vllm#44701 re-applied on vLLM 0.33.0: a LoRA adapter named ``x`` and a cache salt ``x``
share the first block's cache key.

* Tracker: https://github.com/vllm-project/vllm/issues/44701 ("V1 prefix-cache extra-key
  domain collision between LoRA name and cache_salt").
* Fix: https://github.com/vllm-project/vllm/pull/44706 ("domain-tag LoRA and cache_salt
  prefix-cache keys"). vLLM 0.33.0 ships the tagged keys (below).

The bug. vLLM keys a full block by ``hash((parent hash, block tokens, extra keys))``, and
``generate_block_hash_extra_keys`` (``vllm/v1/core/kv_cache_utils.py``) builds the extra
keys as ``lora keys + mm keys + cache-salt keys + prompt-embeds keys``. Before the fix the
LoRA key and the cache-salt key were both bare strings, so for block 0 of one prompt a
request on LoRA adapter ``x`` (no salt) and a base-model request with ``cache_salt="x"``
had the same extra keys, ``("x",)``, hence the same block hash: the salted request was
served K/V computed under the adapter's weights, and the salt's isolation was defeated
by anyone who could name an adapter. Later blocks differ (the LoRA key is in every
block's extra keys, the salt only in block 0's), so exactly one block is shared.

The fix's hunk, before -> after (the "before" lines as the tracker quotes them from main
at a50e675; the "after" lines as vLLM 0.33.0 ships them). This module runs the "before"
side::

    # _gen_lora_extra_hash_keys
    -    return [request.lora_request.lora_name]
    +    return [("lora", lora_request.lora_name, lora_request.lora_path)]
    # generate_block_hash_extra_keys
    -    cache_salt_keys: list[str] = (
    -        [request.cache_salt] if (start_token_idx == 0 and request.cache_salt) else []
    -    )
    +    cache_salt_keys: list[tuple[str, str]] = (
    +        [("cache_salt", request.cache_salt)]
    +        if (start_token_idx == 0 and request.cache_salt)
    +        else []
    +    )

(The fix PR tags the name as ``("lora", name)``; a later change added the adapter's
path, ``("lora", name, path)``, which 0.33.0 ships. The "before" side here is the
tracker's, name only. The adapter derives each path from its name, so dropping the path
changes no key comparison in the suite's workloads.)

How it matches the tracker. The installed vLLM 0.33.0 has the fixed form, read from
``vllm/v1/core/kv_cache_utils.py``:

* line 590: ``def _gen_lora_extra_hash_keys(request: Request) -> list[tuple[str, str, str]]:``
* line 607: ``return [("lora", lora_request.lora_name, lora_request.lora_path)]``
* lines 659-663: ``cache_salt_keys: list[tuple[str, str]] = ( [("cache_salt",
  request.cache_salt)] if (start_token_idx == 0 and request.cache_salt) else [] )``
* lines 668-670: ``extra_keys: list[Any] = ( lora_extra_keys + mm_extra_keys +
  cache_salt_keys + prompt_embeds_keys )``, the same concatenation the tracker quotes.

The module refuses to import (:func:`refserve.conformance.corpus.hunk.require_lines`)
unless the installed
source still has those two fixed lines, so the patch never lands on code it was not
written against. The tracker's reproduction (a LoRA request with name ``COLLIDE_SALT``,
then a base request with ``cache_salt="COLLIDE_SALT"`` and the same prompt, which hit the
LoRA request's block) is the suite's scenario ``keys-salt-named-like-adapter`` with ``x``
for the name: A on adapter ``x``, then B with salt ``x`` after A finished. Under the
patch vLLM hands B the block A filled with the prompt's first 4 tokens (a PREFIX
finding, rule ``key-domains``); without it, B gets no hit.

Where vLLM 0.33.0 computes or reads block hashes, and how the buggy path stays one
consistent engine, on this adapter's objects only:

* ``Request.update_block_hashes`` (``vllm/v1/request.py``, lines 285-288) extends
  ``request.block_hashes`` with ``self._block_hasher(self)`` at construction and on
  every appended token. The hasher is the one handed to ``Request(block_hasher=...)``;
  ``EngineCore.__init__`` (``vllm/v1/engine/core.py``, lines 219-230) builds it with
  ``get_request_block_hasher`` (``kv_cache_utils.py``, line 953), whose closure calls
  ``generate_block_hash_extra_keys`` (line 1020; with lookahead tokens, through
  ``generate_lookahead_block_hash_extra_keys``, line 1039) and ``hash_block_tokens``
  (line 707). This is the one place a block hash is computed. The buggy adapter gives
  its requests :func:`get_request_block_hasher_44701`: vLLM's own
  ``get_request_block_hasher`` and ``generate_lookahead_block_hash_extra_keys`` code,
  bound to a *copy* of ``kv_cache_utils``'s globals in which
  ``generate_block_hash_extra_keys`` is :func:`generate_block_hash_extra_keys_44701`.
  The module's own globals are never written, so the fixed adapter, and any vLLM code,
  in the same process keeps the fixed keys.
* The KV cache manager and ``BlockPool`` only read hashes: ``get_computed_blocks``
  (``kv_cache_manager.py``, line 266) looks up ``request.block_hashes`` (line 305), and
  ``cache_full_blocks`` (``block_pool.py``, line 230) indexes them, so both follow the
  request's hasher; nothing else in ``vllm/v1/core`` computes a block hash.
* ``block_pool.py`` imports ``generate_block_hash_extra_keys`` by name (line 22) and
  calls it only in ``_generate_event_extra_keys`` (line 366), for KV events, which are
  off here (no ``kv_events_config``). Even with events on, the events publish
  ``to_event_extra_keys(...)``: the tags stripped, which is the untagged pre-fix form
  already, so the buggy engine's events would be the pre-fix ones unchanged. Left alone.
* ``vllm/v1/simple_kv_offload/manager.py`` also calls it; no KV connector runs here.

Nothing else of vLLM is changed: the scheduler, the KV manager and the pool are the
installed ones, built by the fixed adapter's ``configure``.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from refserve.conformance.adapters import vllm as fixed
from refserve.conformance.corpus.hunk import require_lines

FIXED = "refserve.conformance.adapters.vllm:make"
BUGGY = "refserve.conformance.corpus.patches.vllm_44701:make"

_utils: Any = importlib.import_module("vllm.v1.core.kv_cache_utils")

_FIXED_LORA_LINE = 'return [("lora", lora_request.lora_name, lora_request.lora_path)]'
_FIXED_SALT_LINE = '[("cache_salt", request.cache_salt)]'


require_lines("vllm#44701", _utils._gen_lora_extra_hash_keys, (_FIXED_LORA_LINE,))
require_lines("vllm#44701", _utils.generate_block_hash_extra_keys, (_FIXED_SALT_LINE,))


def _gen_lora_extra_hash_keys_44701(request: Any) -> list[str]:
    """``_gen_lora_extra_hash_keys`` before the fix: the bare adapter name."""
    if not request.lora_request:
        return []
    return [request.lora_request.lora_name]


def generate_block_hash_extra_keys_44701(
    request: Any, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """vLLM 0.33.0's ``generate_block_hash_extra_keys`` with the pre-fix LoRA and
    cache-salt keys; the multimodal and prompt-embeds keys are vLLM's own functions."""
    mm_extra_keys: list[Any]
    mm_extra_keys, new_start_mm_idx = _utils._gen_mm_extra_hash_keys(
        request, start_token_idx, end_token_idx, start_mm_idx
    )
    lora_extra_keys = _gen_lora_extra_hash_keys_44701(request)
    cache_salt_keys: list[str] = (
        [request.cache_salt] if (start_token_idx == 0 and request.cache_salt) else []
    )
    prompt_embeds_keys = _utils._gen_prompt_embeds_extra_hash_keys(
        request, start_token_idx, end_token_idx
    )
    extra_keys: list[Any] = lora_extra_keys + mm_extra_keys + cache_salt_keys + prompt_embeds_keys
    if not extra_keys:
        return None, new_start_mm_idx
    return tuple(extra_keys), new_start_mm_idx


def _rebind(fn: Any, namespace: dict[str, Any]) -> Any:
    """``fn``'s own code, resolving its global names in ``namespace``."""
    return types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)


def _global_names(code: types.CodeType) -> set[str]:
    """Every name ``code`` and the functions defined in it may look up as a global."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


# A copy of the module's globals: the installed module keeps its fixed function.
_GLOBALS_44701: dict[str, Any] = dict(vars(_utils))
_GLOBALS_44701["generate_block_hash_extra_keys"] = generate_block_hash_extra_keys_44701
_GLOBALS_44701["generate_lookahead_block_hash_extra_keys"] = _rebind(
    _utils.generate_lookahead_block_hash_extra_keys, _GLOBALS_44701
)
get_request_block_hasher_44701: Any = _rebind(_utils.get_request_block_hasher, _GLOBALS_44701)
"""vLLM's ``get_request_block_hasher`` whose hashes take the pre-fix extra keys."""

# The copy is taken once, so a global the module reassigns at run time (``NONE_HASH``,
# set by ``init_none_hash``) would be stale in it; the rebound code must not read one.
# ``hash_block_tokens`` reads NONE_HASH from the installed module, where it is current.
_STALE = {"NONE_HASH"}
for _fn in (_utils.get_request_block_hasher, _utils.generate_lookahead_block_hash_extra_keys):
    if _global_names(_fn.__code__) & _STALE:
        raise ImportError(f"vllm#44701: {_fn.__name__} reads a global the copy cannot track")


class Vllm44701Adapter(fixed.VllmAdapter):
    """The vLLM adapter whose requests hash their blocks with the pre-fix extra keys."""

    @property
    def name(self) -> str:
        return f"{super().name} + vllm#44701 re-applied"

    def make_block_hasher(
        self, hash_block_size: int, hash_fn: Any, num_hash_lookahead_tokens: int
    ) -> Any:
        return get_request_block_hasher_44701(hash_block_size, hash_fn, num_hash_lookahead_tokens)


def make() -> Vllm44701Adapter:
    """Factory for ``--adapter refserve.conformance.corpus.patches.vllm_44701:make``."""
    return Vllm44701Adapter()
