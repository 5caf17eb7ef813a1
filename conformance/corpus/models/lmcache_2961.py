"""Model of LMCache/LMCache#2961: LMCache's cache key leaves out the LoRA adapter.

* Tracker: https://github.com/LMCache/LMCache/issues/2961 ("LoRA-aware KV cache keying
  for Multi-LoRA serving", 2026-04): LMCache keys a chunk of K/V by its tokens, so a
  request on one adapter can be served K/V another adapter computed. The same hole in
  vLLM's LMCache MP connector was reproduced on an A100 in
  https://github.com/vllm-project/vllm/issues/44250 (vLLM 0.22.1rc1, LMCache 0.4.7.dev7,
  local prefix caching off): external entries are namespaced by base model, chunk hashes,
  token range, rank and ``cache_salt``, not by the adapter, and a request on adapter B
  got LMCache hits for blocks stored by adapter A with the same tokens and salt.
* Fix: https://github.com/vllm-project/vllm/pull/45549 (open): the adapter's name is
  folded into the internal cache salt, domain-separated and hashed per component, and
  that salt is used for lookup, store and retrieve alike.

What is modelled (:mod:`.keyed`): the key. LMCache's store is played by refserve's
prefix cache, whose key covers whatever namespace the request enters with; the buggy
model hands it the cache salt only (:func:`lmcache_key`), the fixed one the salt with
the adapter folded in (:func:`folded_key`). Chunking, the store's tiers and its
eviction are not modelled: the bug is in what the key is built from, not in where the
K/V is kept. Caught by ``keys-lora`` (PREFIX, rule ``key-domains``).
"""

from __future__ import annotations

import hashlib

from refserve.conformance.adapter import RequestSpec
from refserve.conformance.corpus.models.keyed import KeyedRef
from refserve.spec.hashing import Namespace


def lmcache_key(request: RequestSpec) -> Namespace:
    """The buggy key's inputs besides the tokens: the cache salt; the adapter is dropped."""
    return Namespace(cache_salt=request.cache_salt)


def _digest(part: str, value: str) -> str:
    return hashlib.sha256(f"{part}\x00{value}".encode()).hexdigest()[:16]


def folded_key(request: RequestSpec) -> Namespace:
    """The fixed key: one internal salt that carries the adapter and the user's salt,
    each hashed under its own tag, so neither can pass for the other."""
    if not (request.lora or request.cache_salt):
        return Namespace()
    salt = f"lora={_digest('lora', request.lora)};salt={_digest('salt', request.cache_salt)}"
    return Namespace(cache_salt=salt)


def make() -> KeyedRef:
    """The buggy model: the adapter never reaches the key."""
    return KeyedRef("lmcache-model", lmcache_key)


def make_fixed() -> KeyedRef:
    """The fixed model: the adapter folded into the salt."""
    return KeyedRef("lmcache-model", folded_key)
