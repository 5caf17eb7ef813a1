"""Prefix-cache keys never collide across namespaces (PREFIX invariant).

``Namespace.root_key`` once joined model, adapter and cache salt with NUL bytes, so model
``"a\\0b"`` had the root of model ``"a"`` + adapter ``"b\\0"``: a block cached by one tenant
was a prefix hit for the other's identical tokens. Each field is now length-prefixed.
Within one namespace, a block-key collision is refused by lookup's identity check.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import refserve.kv.prefix_index as prefix_index_module
from refserve.kv import BlockPool
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace, chain_keys

#: Pairs that shared one root under the NUL-joined encoding.
COLLIDED_BEFORE: list[tuple[Namespace, Namespace]] = [
    (Namespace(model="a\x00b"), Namespace(model="a", adapter="b\x00")),
    (Namespace(model="a\x00b", adapter="c"), Namespace(model="a", adapter="b\x00c")),
    (Namespace(model="a\x00b"), Namespace(model="a", adapter="b", cache_salt="\x00")),
    (Namespace(model="m", adapter="\x00x"), Namespace(model="m\x00", adapter="x")),
    (Namespace(adapter="s\x00", cache_salt=""), Namespace(adapter="s", cache_salt="\x00")),
]


def _v1_root_payload(ns: Namespace) -> bytes:
    """The old encoding, kept here only to show these pairs really collided under it."""
    fields = (ns.model, ns.adapter, ns.cache_salt)
    return b"refserve-prefix-v1\x00" + b"\x00".join(f.encode() for f in fields)


def test_namespaces_that_collided_under_nul_joining_now_differ() -> None:
    for one, other in COLLIDED_BEFORE:
        assert one != other
        assert _v1_root_payload(one) == _v1_root_payload(other), (one, other)
        assert one.root_key() != other.root_key(), (one, other)


def test_equal_namespaces_still_share_a_root() -> None:
    for ns in (DEFAULT_NAMESPACE, *(n for pair in COLLIDED_BEFORE for n in pair)):
        twin = Namespace(ns.model, ns.adapter, ns.cache_salt)
        assert twin.root_key() == ns.root_key()
        assert len(ns.root_key()) == 32
    assert Namespace().root_key() == DEFAULT_NAMESPACE.root_key()


# An alphabet of NULs and two letters makes field-boundary collisions likely to be drawn.
_field = st.text(alphabet="ab\x00", max_size=4)
_namespaces = st.builds(Namespace, model=_field, adapter=_field, cache_salt=_field)


@given(_namespaces, _namespaces)
def test_root_keys_are_equal_exactly_when_namespaces_are(one: Namespace, other: Namespace) -> None:
    assert (one.root_key() == other.root_key()) == (one == other)


@given(_namespaces, st.data())
def test_moving_a_field_boundary_onto_another_nul_changes_the_root(
    ns: Namespace, data: st.DataObject
) -> None:
    """Every re-split of the NUL-joined fields at two of its NULs: the namespaces whose v1
    payload equals ``ns``'s. Each must have its own root unless it is ``ns`` itself."""
    joined = "\x00".join((ns.model, ns.adapter, ns.cache_salt))
    nuls = [i for i, c in enumerate(joined) if c == "\x00"]
    i, j = sorted(data.draw(st.lists(st.sampled_from(nuls), min_size=2, max_size=2, unique=True)))
    other = Namespace(joined[:i], joined[i + 1 : j], joined[j + 1 :])
    assert _v1_root_payload(other) == _v1_root_payload(ns)
    assert (other.root_key() == ns.root_key()) == (other == ns)


def test_a_cached_block_is_no_hit_in_the_colliding_namespace() -> None:
    """End to end through the pool: tenant A's cached prompt is invisible to tenant B."""
    tenant_a, tenant_b = COLLIDED_BEFORE[0]
    pool = BlockPool(8, 4)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    pool.allocate("a", tokens, len(tokens), namespace=tenant_a)
    pool.free("a")  # its two full blocks stay cached
    assert pool.lookup(tokens, tenant_a).block_ids  # the same namespace still hits
    assert pool.lookup(tokens, Namespace(tenant_a.model)).block_ids
    miss = pool.lookup(tokens, tenant_b)
    assert miss.block_ids == () and miss.root_key == tenant_b.root_key()
    assert chain_keys(tenant_a.root_key(), tokens, 4, 2) != chain_keys(
        tenant_b.root_key(), tokens, 4, 2
    )


@pytest.mark.mutation_kill
def test_a_key_collision_in_lookup_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    # A block key that ignores the parent makes "token 6 after 5" and "token 6 first"
    # collide; lookup's identity check (stored parent key) must refuse the reuse.
    monkeypatch.setattr(prefix_index_module, "block_key", lambda parent, tokens: bytes(tokens))
    pool = BlockPool(4, 1)
    pool.allocate("a", [5, 6], 2)
    assert pool.lookup([5, 6, 7]).block_ids == (0, 1)
    assert pool.lookup([6, 7]).block_ids == ()
