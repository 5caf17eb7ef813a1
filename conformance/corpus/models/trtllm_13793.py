"""Model of NVIDIA/TensorRT-LLM#13793: the V2 KV cache manager ignored the cache salt.

* Tracker and fix: https://github.com/NVIDIA/TensorRT-LLM/pull/13793 ("Support
  cache_salt_id in KV cache v2 manager", merged 2026-05). TensorRT-LLM keys reusable
  blocks per request seed; the V1 manager mixes the request's ``cache_salt_id`` into the
  root block's hash (``cpp/tensorrt_llm/batch_manager/blockKey.cpp``), but
  ``KVCacheManagerV2`` (``tensorrt_llm/runtime/kv_cache_manager_v2``) rooted its
  ``BlockRadixTree`` at a seed that, as the PR says, "until this PR, was just
  ``lora_task_id``". A salted request was accepted and its salt never reached a key:
  two tenants with different salts and the same prompt shared blocks.
* The fix (``_KVCache._make_tree_task_id``, quoted in the PR's review): when
  ``cache_salt_id`` is set, the seed is a SHA-256 digest of ``(lora_task_id,
  cache_salt_id)``; without a salt it stays ``lora_task_id``.

What is modelled (:mod:`.keyed`): the seed. refserve's prefix cache plays the radix
tree, rooted at the namespace the request enters with: the adapter alone in the buggy
model (:func:`v2_seed`), the adapter and the salt in the fixed one
(:func:`salted_seed`). Caught by ``keys-cache-salt`` (PREFIX, rule ``key-domains``).
"""

from __future__ import annotations

from refserve.conformance.adapter import RequestSpec
from refserve.conformance.corpus.models.keyed import KeyedRef
from refserve.spec.hashing import Namespace


def v2_seed(request: RequestSpec) -> Namespace:
    """The buggy seed: the LoRA task alone; the salt is dropped."""
    return Namespace(adapter=request.lora)


def salted_seed(request: RequestSpec) -> Namespace:
    """The fixed seed: the LoRA task and the salt (the salt only when there is one)."""
    return Namespace(adapter=request.lora, cache_salt=request.cache_salt)


def make() -> KeyedRef:
    """The buggy model: the salt never reaches the radix tree's root."""
    return KeyedRef("tensorrt-llm-model", v2_seed)


def make_fixed() -> KeyedRef:
    """The fixed model: the salt mixed into the root."""
    return KeyedRef("tensorrt-llm-model", salted_seed)
