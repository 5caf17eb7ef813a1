"""The grouped KV protocol: a block manager whose layers form groups (full attention,
sliding window), each with its own table per request over one shared pool of blocks
(spec/groups.py has the rules and the window convention).

The suite plays the scheduler and the model, as for a plain manager
(conformance/kv/protocol.py), with these differences:

* ``configure(GroupedKVConfig)`` names the groups; one pool of ``num_blocks`` blocks of
  ``block_size`` tokens serves them all.
* ``allocate(request_id, token_ids, num_new_tokens)`` returns one table per group
  (:class:`GroupedAllocation`); a window group's table keeps the places of the blocks
  that left its window as :data:`refserve.spec.groups.NULL_BLOCK`. A hit, on a first
  allocation, is the same number of tokens in every group, whole blocks, and at most the
  full cached blocks of ``token_ids[:len(token_ids) - num_new_tokens]``.
* After each allocation the suite writes each new token's id at its slot in each group's
  own fake memory, and reads back, in every group, the positions that group's next query
  reads: all of them in a full group, those from ``window_start`` on in a window group.
  It checks :func:`refserve.spec.groups.check_groups` and
  :func:`refserve.spec.groups.check_window_held` after every allocation.
* :class:`NoSpace` (the manager cannot serve the call now, nothing changed) is an
  acceptable answer only when the shared pool lacks the blocks the call needs in all
  groups together, counted without a cache hit.
* ``free(request_id)`` releases the request's blocks in every group; ``snapshot()`` is a
  :class:`refserve.spec.groups.GroupedSnapshot`.
* ``features``: ``prefix_caching`` (and ``prefix_caching_optional``) as for a plain
  manager, and ``window_eager_free`` when every allocation releases the request's
  window blocks wholly before its window: only then is a block kept past it a finding
  (rule ``window-late``). The suite is :mod:`refserve.conformance.kv.grouped_suite`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from refserve.conformance.kv.protocol import KVFeature
from refserve.spec.groups import GroupedSnapshot, KVGroup


@dataclass(frozen=True)
class GroupedKVConfig:
    num_blocks: int
    block_size: int
    groups: tuple[KVGroup, ...]
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class GroupedAllocation:
    """What one :meth:`GroupedKVAdapter.allocate` did: each group's whole table after
    the call, in the config's group order, and the tokens served from the cache."""

    block_tables: tuple[tuple[int, ...], ...]
    num_cached_tokens: int = 0


@runtime_checkable
class GroupedKVAdapter(Protocol):
    """Drives one grouped block manager (the module doc gives the semantics)."""

    @property
    def name(self) -> str: ...

    @property
    def features(self) -> frozenset[KVFeature]: ...

    def configure(self, config: GroupedKVConfig) -> None: ...

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int
    ) -> GroupedAllocation: ...

    def free(self, request_id: str) -> None: ...

    def snapshot(self) -> GroupedSnapshot: ...


GroupedKVAdapterFactory = Callable[[], GroupedKVAdapter]
"""A zero-argument callable returning a fresh grouped KV adapter (``MODULE:FACTORY``)."""
