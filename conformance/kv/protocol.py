"""The KV adapter protocol: how the suite drives a block manager alone.

The suite plays the scheduler and the model. It asks the manager for room for some new
tokens of a request (:meth:`KVAdapter.allocate`), writes each new token's id into a fake
KV memory at the slot the returned block table gives (after performing the returned
copy-on-write copies), forks and frees requests, and after every operation checks the
pool snapshot (BLOCK, CAP, POS, PREFIX) and that every request reads back exactly its own
tokens through its table. A refused allocation (:class:`NoSpace`) must leave the
snapshot unchanged (ATOMIC) and is itself a finding when the pool visibly had room.

Semantics every KV adapter must follow
--------------------------------------
* ``configure`` builds a fresh manager: every block free, no request, an empty cache.
  It raises :class:`refserve.conformance.adapter.NotSupported` for a configuration the manager
  cannot take.
* ``allocate(request_id, token_ids, num_new_tokens)``: ``token_ids`` are all the tokens
  the request knows (prompt plus outputs so far); after the call the request's KV length
  (``TableSnapshot.num_stored``) is its previous length, plus any prompt tokens served
  from the prefix cache (only on the request's first allocation, reported as
  ``Allocation.num_cached_tokens``), plus ``num_new_tokens``. The returned
  :class:`Allocation` holds the request's whole block table and the (src, dst) block
  copies the executor must perform before writing (copy-on-write of a shared partial
  last block). A manager that cannot serve the call raises :class:`NoSpace` and changes
  nothing.
* A cache hit (PREFIX) is whole blocks, and ``num_cached_tokens + num_new_tokens <=
  len(token_ids)`` (so the last known token is always computed): the suite, playing the
  scheduler, picks ``num_new_tokens`` before it knows the hit, and the manager serves at
  most the full cached blocks of ``token_ids[:len(token_ids) - num_new_tokens]`` (any
  shorter hit, or none, is a correct choice too).
* :class:`NoSpace` is an acceptable answer only when the pool lacks room (CAP): the
  blocks the call needs served *without* a cache hit (a hit on free cached blocks takes
  them out of the free set, so a manager that cannot afford the hit serves without it),
  plus one for a copy-on-write, exceed the free blocks of the snapshot.
* ``fork(parent, child)`` (feature ``fork``): the child shares every block of the
  parent (reference counts go up; no block is copied, so fork needs no free block and
  never raises :class:`NoSpace`); a later write into a shared partial block must be
  preceded by a copy.
* ``free(request_id)``: the request's blocks are released (reference counts go down;
  a block reaching zero becomes free, possibly still indexed by the prefix cache).
* ``snapshot()``: a :class:`refserve.spec.snapshot.PoolSnapshot` of the manager: ref counts, the
  free blocks (in hand-out order if the manager has one; the suite does not check the
  order at this level), one :class:`refserve.spec.snapshot.TableSnapshot` per live request, and
  (feature ``cache_index``) the prefix-cache entries keyed by
  :func:`refserve.spec.hashing.block_key` chained from the tables' ``root_key`` (``b""`` for a
  manager without namespaces; without feature ``key_domains`` the suite uses a single
  namespace, so every table has the same root).
* ``set_namespace(request_id, namespace)`` (feature ``key_domains``; protocol
  :class:`KVNamespaces`): the key namespace (:class:`refserve.spec.hashing.Namespace`:
  LoRA adapter, cache salt) of the request's next first allocation, called before every
  first allocation; it holds until the request is freed (a fork's child inherits its
  parent's). Requests of different namespaces must never share K/V, whatever their
  tokens: the suite records with each written token the namespace it was computed in,
  and a request reading back a token computed in another one is PREFIX (rule
  ``key-domains``). An adapter that reports tables' ``root_key`` reports
  ``namespace.root_key()``.
* Which free block is handed out, the free-queue order and when cached blocks are
  evicted are the manager's design choices: the suite never compares them.

Any other exception, or a call that runs past the time limit, is a fault of the adapter
(a PROGRESS finding naming the call, refserve.conformance.guard); so is a snapshot that is not
shaped like a PoolSnapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from refserve.spec.hashing import Namespace
from refserve.spec.snapshot import PoolSnapshot


class KVFeature(StrEnum):
    FORK = "fork"
    """:meth:`KVAdapter.fork` works (shared blocks, copy-on-write)."""
    PREFIX_CACHING = "prefix_caching"
    """A first allocation may be served partly from the prefix cache."""
    PREFIX_CACHING_OPTIONAL = "prefix_caching_optional"
    """Prefix caching can be switched off by ``KVConfig.enable_prefix_caching``."""
    CACHE_INDEX = "cache_index"
    """The snapshot lists the cache index as spec.CacheEntry records (spec hash chain)."""
    KEY_DOMAINS = "key_domains"
    """Requests carry a key namespace (:meth:`KVNamespaces.set_namespace`); the suite's
    ``new`` ops may name a LoRA adapter and a cache salt."""
    WINDOW_EAGER_FREE = "window_eager_free"
    """Grouped managers only (conformance/kv/groups.py): every allocation releases the
    request's window-group blocks that have left its window, so the suite also holds it
    to rule ``window-late``. Without it, when a window block goes back is the manager's
    choice (a lazy manager frees them when it needs room)."""


GROUPED_KV_FEATURES = frozenset({KVFeature.WINDOW_EAGER_FREE})
"""The features only a grouped manager (conformance/kv/groups.py) can declare."""

ALL_KV_FEATURES = frozenset(KVFeature) - GROUPED_KV_FEATURES
"""Every feature a plain manager (:class:`KVAdapter`) can declare."""


@dataclass(frozen=True)
class KVConfig:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class Allocation:
    """What one :meth:`KVAdapter.allocate` did."""

    block_table: tuple[int, ...]
    """The request's whole block table after the call."""
    num_cached_tokens: int = 0
    """Tokens served from the prefix cache by this call (first allocation only)."""
    copies: tuple[tuple[int, int], ...] = ()
    """(src, dst) block copies the executor performs before writing (copy-on-write)."""


class NoSpace(Exception):
    """The manager cannot serve this allocation now; it changed nothing."""


@runtime_checkable
class KVAdapter(Protocol):
    """Drives one block manager; see the module docstring for the exact semantics."""

    @property
    def name(self) -> str: ...

    @property
    def features(self) -> frozenset[KVFeature]: ...

    def configure(self, config: KVConfig) -> None: ...

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation: ...

    def fork(self, parent: str, child: str) -> None: ...

    def free(self, request_id: str) -> None: ...

    def snapshot(self) -> PoolSnapshot: ...


@runtime_checkable
class KVNamespaces(Protocol):
    """What an adapter with feature ``key_domains`` adds to :class:`KVAdapter` (a
    protocol of its own, so adapters without the feature need nothing new)."""

    def set_namespace(self, request_id: str, namespace: Namespace) -> None: ...


KVAdapterFactory = Callable[[], KVAdapter]
"""A zero-argument callable returning a fresh KV adapter (``MODULE:FACTORY`` on the CLI)."""

KV_ADAPTER_ATTRIBUTES = ("name", "features")
"""The data members of :class:`KVAdapter`."""
KV_ADAPTER_METHODS = ("configure", "allocate", "fork", "free", "snapshot")
"""The methods of :class:`KVAdapter` (``fork`` too: without feature ``fork`` it raises
:class:`refserve.conformance.adapter.NotSupported`)."""
