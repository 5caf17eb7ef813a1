"""refserve's engine with another engine's cache key: the base of the key-domain models.

The models of this kind are about one thing, which inputs of a request's K/V the
modelled engine's prefix-cache key is built from. Everything else (scheduling, the
block pool, the cache itself) is refserve's, which passes the suite: a hit in
refserve's prefix cache stands for a hit in the modelled engine's cache, and the
request reaches the engine under the :class:`Namespace` the modelled key would give it.
The suite keeps each request's true key domain in its own books (the fake KV memory
records it per slot), so a key that leaves out an input shows as K/V read back from
another domain (PREFIX, rule ``key-domains``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from refserve.conformance.adapter import RequestSpec
from refserve.conformance.adapters.ref import RefAdapter
from refserve.spec.hashing import Namespace

#: The modelled cache's key inputs for a request: what it keeps of the adapter and salt.
KeyOf = Callable[[RequestSpec], Namespace]


class KeyedRef(RefAdapter):
    """refserve's scheduler and pool; each request enters under the namespace ``key_of``
    gives it (the modelled engine's cache key), so its blocks are shared with exactly the
    requests that key confuses it with. Tables report the engine's own root keys."""

    def __init__(self, name: str, key_of: KeyOf) -> None:
        super().__init__()
        self.name = name
        self._key_of = key_of

    def add_request(self, request: RequestSpec) -> None:
        key = self._key_of(request)
        keyed = dataclasses.replace(request, lora=key.adapter, cache_salt=key.cache_salt)
        super().add_request(keyed)
