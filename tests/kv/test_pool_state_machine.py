"""Hypothesis state machine: refserve.kv.BlockPool against the abstract oracle
(refserve.spec.abstract_pool.AbstractPool).

Both pools receive the same random operations on tiny pools (so exhaustion, eviction and
copy-on-write happen often). After every rule:

* ``pool.snapshot() == model.snapshot()`` (free-queue order, cache entries, tables);
* ``refserve.spec.check_pool`` reports nothing;
* the test's own accounting agrees: each request's logical token list (kept here, never
  read back from the pool), ref counts recomputed from the block tables, used + free;
* a **fake KV memory** (slot -> token id, written by this test on every allocation after
  applying the returned ``BlockCopy`` list) reads back exactly each live request's own
  tokens through its block table. A missing copy-on-write is caught here, not by counts.

Rare paths are labelled with ``event()``; run with ``--hypothesis-show-statistics``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)
from kv_steps import decode_copies
from kv_steps import stored as pool_stored

from refserve.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidArgument,
    OutOfBlocks,
    UnknownRequest,
)
from refserve.kv import Allocation, BlockPool, PrefixHit
from refserve.kv.forks import fork
from refserve.kv.truncation import truncate
from refserve.spec import check_pool
from refserve.spec.abstract_pool import AbstractPool
from refserve.spec.arith import blocks_needed, max_cacheable_tokens, slot_of
from refserve.spec.events import check_events
from refserve.spec.hashing import Namespace, chain_keys
from refserve.spec.snapshot import CacheEntry

NAMESPACES = (Namespace(), Namespace(adapter="lora-1"))
ALPHABET = st.integers(min_value=0, max_value=2)
POISONED = -1  # a rejected draft's slot in the fake memory: never a token id


class PoolMachine(RuleBasedStateMachine):
    pool: BlockPool
    model: AbstractPool

    def __init__(self) -> None:
        super().__init__()
        self.bs = 1
        self.num_blocks = 1
        self.caching = True
        # The test's own view of every live request.
        self.stored: dict[str, list[int]] = {}  # tokens whose KV the request holds
        self.known: dict[str, list[int]] = {}  # prompt + outputs known so far
        self.ns: dict[str, Namespace] = {}
        self.history: list[list[int]] = []  # token lists ever stored, to make prefixes collide
        self.memory: dict[int, int] = {}  # fake KV memory: slot -> token id
        self.next_id = 0
        # A subscriber's copy of the cache index, built from the published cache events
        # alone (spec/events.py, EVENTS), and the sequence number it expects next.
        self.replica: tuple[CacheEntry, ...] = ()
        self.next_seq = 0

    # ------------------------------------------------------------------ setup
    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.integers(1, 5),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.num_blocks, self.bs, self.caching = num_blocks, block_size, caching
        self.pool = BlockPool(
            num_blocks, block_size, enable_prefix_caching=caching, cache_events=True
        )
        self.model = AbstractPool(num_blocks, block_size, prefix_caching=caching)

    # ---------------------------------------------------------------- helpers
    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _draw_prompt(self, data: st.DataObject) -> list[int]:
        """Often a prefix of something seen before plus a short tail, so hits are common."""
        tail = data.draw(st.lists(ALPHABET, min_size=0, max_size=self.bs + 2), label="tail")
        if self.history and data.draw(st.sampled_from([True, True, True, False]), label="reuse"):
            base = data.draw(st.sampled_from(self.history), label="base")
            whole = data.draw(st.booleans(), label="whole_base")
            k = len(base) if whole else data.draw(st.integers(0, len(base)), label="prefix_len")
            prompt = base[:k] + tail
        else:
            prompt = tail
        if not prompt:
            prompt = [data.draw(ALPHABET, label="first")]
        return prompt

    def _holders(self) -> Counter[int]:
        return Counter(b for rid in self.stored for b in self.pool.block_table(rid))

    def _used(self) -> int:
        return len(self._holders())

    def _expected_need(self, rid: str, n: int, hit: PrefixHit | None) -> tuple[int, int]:
        """(free blocks consumed, blocks the table holds afterwards), computed here."""
        holders = self._holders()
        if rid in self.stored:
            table = self.pool.block_table(rid)
            start = len(self.stored[rid])
            fresh = max(0, blocks_needed(start + n, self.bs) - len(table))
            cow = start % self.bs != 0 and holders[table[-1]] > 1
            return fresh + int(cow), blocks_needed(start + n, self.bs)
        hit_blocks = hit.block_ids if hit is not None else ()
        start = len(hit_blocks) * self.bs
        fresh = max(0, blocks_needed(start + n, self.bs) - len(hit_blocks))
        revived = sum(1 for b in hit_blocks if holders[b] == 0)
        return fresh + revived, blocks_needed(start + n, self.bs)

    def _write_kv(self, rid: str, alloc: Allocation) -> None:
        """What the executor would do: copy-on-write first, then write the new tokens."""
        bs = self.bs
        for c in alloc.copies:
            for off in range(bs):
                src = c.src * bs + off
                if src in self.memory:
                    self.memory[c.dst * bs + off] = self.memory[src]
                else:
                    self.memory.pop(c.dst * bs + off, None)
        table = self.pool.block_table(rid)
        tokens = self.stored[rid]
        for p in range(alloc.start_position, alloc.start_position + alloc.num_new_tokens):
            self.memory[slot_of(table[p // bs], p, bs)] = tokens[p]

    def _allocate(
        self,
        rid: str,
        tokens: list[int],
        n: int,
        hit: PrefixHit | None,
        ns: Namespace,
    ) -> bool:
        """Allocate on both pools; predict the outcome here; check all-or-nothing."""
        new = rid not in self.stored
        need, total = self._expected_need(rid, n, hit)
        free = self.num_blocks - self._used()
        before = self.pool.snapshot()
        if total > self.num_blocks:
            expected_error: type[Exception] | None = ExceedsCapacity
        elif need > free:
            expected_error = OutOfBlocks
        else:
            expected_error = None
        use_cache = hit is not None
        if expected_error is not None:
            with pytest.raises(expected_error) as info:
                self.pool.allocate(rid, tokens, n, hit=hit, namespace=ns)
            assert repr(rid) in str(info.value)
            event(f"allocate refused: {expected_error.__name__}")
            assert not self.model.allocate(rid, tokens, n, ns.root_key(), use_cache)
            assert self.pool.snapshot() == before
            return False
        cached_before = {e.key for e in before.cache_entries}
        ref_before = before.ref_cnt
        alloc = self.pool.allocate(rid, tokens, n, hit=hit, namespace=ns)
        assert self.model.allocate(rid, tokens, n, ns.root_key(), use_cache)
        hit_tokens = hit.num_tokens if hit is not None else 0
        start = hit_tokens if new else len(self.stored[rid])
        assert alloc.start_position == start
        assert alloc.num_new_tokens == n
        assert alloc.num_cached_tokens == (hit_tokens if new else 0)
        if new:
            self.stored[rid] = list(tokens[:hit_tokens])
            self.known[rid] = list(tokens)
            self.ns[rid] = ns
        self.stored[rid].extend(tokens[start : start + n])
        self.history.append(list(self.stored[rid]))
        if len(self.history) > 8:
            self.history.pop(0)
        after = self.pool.snapshot()
        # Only popping a cached free block removes an entry during allocate.
        if cached_before - {e.key for e in after.cache_entries}:
            event("allocate evicted a cached block")
        if alloc.copies:
            event("copy-on-write")
            assert len(alloc.copies) == 1
            c = alloc.copies[0]
            assert c.src != c.dst and ref_before[c.src] > 1 and ref_before[c.dst] == 0
            assert after.ref_cnt[c.src] == ref_before[c.src] - 1
        if hit is not None and hit.block_ids:
            event("prefix hit")
            if any(ref_before[b] == 0 for b in hit.block_ids):
                event("revived a free cached block")
            for b in hit.block_ids:
                assert after.ref_cnt[b] == ref_before[b] + 1  # hit blocks only gain a ref
        for b in alloc.new_block_ids:
            assert ref_before[b] == 0 and after.ref_cnt[b] == 1
        self._write_kv(rid, alloc)
        return True

    # ------------------------------------------------------------------ rules
    def _pick(self, data: st.DataObject, label: str) -> str | None:
        """A live request, or None after admitting one instead (no precondition filtering)."""
        if not self.stored:
            self.allocate_new(data)
            return None
        return data.draw(st.sampled_from(sorted(self.stored)), label=label)

    @rule(data=st.data())
    def allocate_new(self, data: st.DataObject) -> None:
        ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        prompt = self._draw_prompt(data)
        use_hit = data.draw(st.sampled_from([True, True, True, False]), label="use_hit")
        hit = self.pool.lookup(prompt, ns) if use_hit else None
        assert hit is None or list(hit.block_ids) == self.model.lookup(prompt, ns.root_key())
        first = hit.num_tokens if hit is not None else 0
        n = data.draw(st.integers(1, len(prompt) - first), label="n")
        self._allocate(self._new_id(), prompt, n, hit, ns)

    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        rid = self._pick(data, "rid")
        if rid is None:
            return
        decode = data.draw(st.booleans(), label="decode")
        n = 1 if decode else data.draw(st.integers(2, 2 * self.bs + 1), label="n")
        known = self.known[rid]
        start = len(self.stored[rid])
        while len(known) < start + n:
            known.append(data.draw(ALPHABET, label="sampled"))
        event("append: decode (n=1)" if decode else "append: chunk (n>1)")
        self._allocate(rid, known, n, None, self.ns[rid])

    @rule(data=st.data())
    def verify_drafts(self, data: st.DataObject) -> None:
        """A step that verifies drafts (docs/SPECULATIVE.md): slots for the last sampled
        token and ``d`` drafts, then only ``a`` drafts kept. The rejected slots are
        poisoned in the fake memory, so reading one later (a kept cache entry, a block
        not returned and read as context) fails the read-back."""
        rid = self._pick(data, "rid")
        if rid is None:
            return
        start = len(self.stored[rid])
        known = self.known[rid]
        last = known[start] if len(known) > start else data.draw(ALPHABET, label="sampled")
        d = data.draw(st.integers(1, 2 * self.bs), label="drafts")
        drafts = data.draw(st.lists(ALPHABET, min_size=d, max_size=d), label="draft ids")
        tokens = [*known[:start], last, *drafts]
        if not self._allocate(rid, tokens, 1 + d, None, self.ns[rid]):
            return
        table = self.pool.block_table(rid)
        accepted = data.draw(st.integers(0, d), label="accepted")
        keep = start + 1 + accepted
        event(f"verify: {'all' if accepted == d else 'some' if accepted else 'no'} drafts kept")
        returned = truncate(self.pool, rid, keep)
        assert self.model.truncate(rid, keep)
        assert returned == list(table[blocks_needed(keep, self.bs) :])
        if returned:
            event("verify: blocks of rejected positions returned")
        for p in range(keep, start + 1 + d):
            self.memory[slot_of(table[p // self.bs], p, self.bs)] = POISONED
        self.stored[rid] = tokens[:keep]
        self.known[rid] = tokens[:keep]

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self._pick(data, "parent")
        if parent is not None:
            self._fork(parent)

    def _fork(self, parent: str) -> str:
        child = self._new_id()
        before = self.pool.snapshot()
        fork(self.pool, parent, child)
        assert self.model.fork(parent, child)
        self.stored[child] = list(self.stored[parent])
        self.known[child] = list(self.stored[parent])  # the child samples its own future
        self.ns[child] = self.ns[parent]
        table = self.pool.block_table(parent)
        assert self.pool.block_table(child) == table
        after = self.pool.snapshot()
        for b in table:
            assert after.ref_cnt[b] == before.ref_cnt[b] + 1
        if len(self.stored[parent]) % self.bs:
            event("fork with a partial last block")
        return child

    @rule(data=st.data())
    def fork_and_write(self, data: st.DataObject) -> None:
        """n > 1 sampling: fork, then one side decodes (copy-on-write if the tail is partial)."""
        parent = self._pick(data, "parent")
        if parent is None:
            return
        child = self._fork(parent)
        writer = data.draw(st.sampled_from([child, parent]), label="writer")
        known = self.known[writer]
        if len(known) == len(self.stored[writer]):
            known.append(data.draw(ALPHABET, label="sampled"))
        self._allocate(writer, known, 1, None, self.ns[writer])

    def _free(self, rid: str) -> None:
        table = self.pool.block_table(rid)
        holders = self._holders()
        free_before = self.pool.snapshot().free_queue
        self.pool.free(rid)
        assert self.model.free_request(rid)
        # Reverse order: the request's tail goes to the back of the LRU queue.
        released = [b for b in reversed(table) if holders[b] == 1]
        assert self.pool.snapshot().free_queue == free_before + tuple(released)
        for d in (self.stored, self.known, self.ns):
            del d[rid]

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = self._pick(data, "rid")
        if rid is not None:
            self._free(rid)

    @rule(data=st.data())
    def free_and_readmit(self, data: st.DataObject) -> None:
        """Recompute preemption: free a request, admit its tokens again with a cache hit."""
        rid = self._pick(data, "rid")
        if rid is None:
            return
        tokens = [*self.stored[rid], data.draw(ALPHABET, label="next")]
        ns = self.ns[rid]
        self._free(rid)
        hit = self.pool.lookup(tokens, ns)
        assert list(hit.block_ids) == self.model.lookup(tokens, ns.root_key())
        if self.caching and len(tokens) > self.bs:
            # Nothing was popped since the free, so every full block is still cached
            # unless another block held its key when it filled and was evicted since.
            full = len(hit.block_ids) == (len(tokens) - 1) // self.bs
            event("readmit: every full block hit" if full else "readmit: partial hit")
        self._allocate(self._new_id(), tokens, len(tokens) - hit.num_tokens, hit, ns)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        prompt = self._draw_prompt(data)
        hit = self.pool.lookup(prompt, ns)
        assert list(hit.block_ids) == self.model.lookup(prompt, ns.root_key())
        assert hit.num_tokens <= max_cacheable_tokens(len(prompt), self.bs)
        if not self.caching:
            assert hit.block_ids == ()
        # Identity, checked against the fake memory rather than the pool's own records.
        for i, b in enumerate(hit.block_ids):
            seen = [
                self.memory.get(slot_of(b, p, self.bs))
                for p in range(i * self.bs, (i + 1) * self.bs)
            ]
            assert seen == prompt[i * self.bs : (i + 1) * self.bs]
        if hit.block_ids:
            event("lookup hit")
            # A hit handed to a prompt that differs inside the hit is refused.
            wrong = list(prompt)
            j = data.draw(st.integers(0, hit.num_tokens - 1), label="corrupt_at")
            wrong[j] = 3  # outside ALPHABET
            before = self.pool.snapshot()
            with pytest.raises(InvalidArgument, match="does not match its token ids"):
                self.pool.allocate(self._new_id(), wrong, 1, hit=hit, namespace=ns)
            assert self.pool.snapshot() == before

    @rule(count=st.integers(0, 3))
    def forget_cached(self, count: int) -> None:
        """The cache entries of the ``count`` least recently freed cached blocks
        dropped (the model's ``evict``) through ``forget_cached``, with a block out of
        range and a repeated one that it skips."""
        cached = [b for b in self.model.free if self.model.cached_block(b) is not None]
        victims = cached[:count]
        got = self.pool.forget_cached([*victims, self.num_blocks, *victims[:1]])
        assert got == self.model.evict(count)
        if got:
            event("forget_cached dropped a cached block")

    @rule(data=st.data())
    def allocate_must_fail(self, data: st.DataObject) -> None:
        """Ask for more than the pool can give, on an existing or a new request."""
        rid = data.draw(st.sampled_from([*sorted(self.stored), "new"]), label="rid")
        if rid == "new":
            rid = self._new_id()
            start = 0
            ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        else:
            start = len(self.stored[rid])
            ns = self.ns[rid]
        capacity = self.num_blocks * self.bs
        free = self.num_blocks - self._used()
        candidates = [
            n for n in range(1, capacity - start + 2) if self._expected_need(rid, n, None)[0] > free
        ]
        n = data.draw(st.sampled_from(candidates), label="n")  # capacity + 1 always qualifies
        known = list(self.known[rid]) if rid in self.known else []
        known += [0] * (start + n - len(known))
        assert not self._allocate(rid, known, n, None, ns)

    @rule(data=st.data())
    def bad_calls(self, data: st.DataObject) -> None:
        """Typed errors that change nothing: unknown ids, duplicate fork, zero count."""
        rid = self._pick(data, "rid")
        if rid is None:
            return
        before = self.pool.snapshot()
        with pytest.raises(UnknownRequest):
            self.pool.free("ghost")
        with pytest.raises(UnknownRequest):
            fork(self.pool, "ghost", "child")
        with pytest.raises(DuplicateRequest):
            fork(self.pool, rid, rid)
        with pytest.raises(InvalidArgument):
            self.pool.allocate(rid, self.known[rid], 0)
        with pytest.raises(UnknownRequest, match="truncate"):
            truncate(self.pool, "ghost", 0)
        stored = len(self.stored[rid])
        with pytest.raises(InvalidArgument, match=f"stores {stored} tokens; it cannot keep"):
            truncate(self.pool, rid, stored + 1)
        with pytest.raises(InvalidArgument, match="num_stored"):
            truncate(self.pool, rid, -1)
        assert self.pool.snapshot() == before

    @rule(data=st.data())
    def decode_batch(self, data: st.DataObject) -> None:
        """The fast decode path: one token for each of several requests, all or nothing."""
        rid0 = self._pick(data, "rid")
        if rid0 is None:
            return
        rids = data.draw(
            st.lists(st.sampled_from(sorted(self.stored)), min_size=1, max_size=4, unique=True),
            label="batch",
        )
        for rid in rids:
            if len(self.known[rid]) == len(self.stored[rid]):
                self.known[rid].append(data.draw(ALPHABET, label="sampled"))
        holders = self._holders()
        needy = 0
        for rid in rids:
            n, table = len(self.stored[rid]), self.pool.block_table(rid)
            needy += n % self.bs == 0 or holders[table[-1]] > 1
        before = self.pool.snapshot()
        copies = decode_copies(self.pool, {rid: self.known[rid] for rid in rids})
        if needy > self.num_blocks - len(holders):
            assert copies is None
            assert self.pool.snapshot() == before
            event("decode batch refused")
            return
        assert copies is not None
        for rid in rids:
            assert self.model.allocate(rid, self.known[rid], 1, b"", False)
        if copies:
            event("decode batch copy-on-write")
        for c in copies:
            for off in range(self.bs):
                src = self.memory.get(c.src * self.bs + off)
                if src is not None:
                    self.memory[c.dst * self.bs + off] = src
        for rid in rids:
            p = len(self.stored[rid])
            self.stored[rid].append(self.known[rid][p])
            table = self.pool.block_table(rid)
            self.memory[slot_of(table[p // self.bs], p, self.bs)] = self.known[rid][p]

    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        """A few operations in a transaction, undone by the rollback."""
        before = self.pool.snapshot()
        live = set(self.stored)
        steps = data.draw(st.integers(1, 4), label="ops")
        did = Counter[str]()
        self.pool.begin()
        self._tx_ops(data, steps, live, did)
        self.pool.rollback()
        assert self.pool.snapshot() == before
        log = self.pool.cache_events
        assert log is not None and log.drain() == [], "a rolled-back step published events"
        if sum(did.values()) >= 2:
            event("rollback undid >= 2 operations")
        if did["decode"]:
            event("rollback undid a decode batch")

    def _tx_ops(self, data: st.DataObject, steps: int, live: set[str], did: Counter[str]) -> None:
        ops = ["append", "decode", "new", "fork", "free", "forget", "truncate"]
        for k in range(steps):
            op = data.draw(st.sampled_from(ops))
            if op == "forget":
                self.pool.forget_cached(data.draw(st.lists(st.integers(0, self.num_blocks - 1))))
                did[op] += 1
                continue
            if op == "new":
                prompt = self._draw_prompt(data)
                hit = self.pool.lookup(prompt)
                try:
                    self.pool.allocate(f"tx{k}", prompt, len(prompt) - hit.num_tokens, hit=hit)
                except (OutOfBlocks, ExceedsCapacity):
                    continue  # refused before mutating; the transaction goes on
                live.add(f"tx{k}")
                did[op] += 1
                continue
            if not live:
                continue
            rid = data.draw(st.sampled_from(sorted(live)))
            if op in ("append", "decode"):
                n = 1 if op == "decode" else data.draw(st.integers(1, self.bs + 1))
                s = pool_stored(self.pool, rid)
                toks = [*self.known.get(rid, [])[:s], *([data.draw(ALPHABET)] * n)]
                toks += [1] * (s + n - len(toks))
                try:
                    if op == "decode":  # a few decode steps, often filling a block
                        for _ in range(data.draw(st.integers(1, self.bs))):
                            if decode_copies(self.pool, {rid: toks}) is None:
                                break
                            toks = [*toks, data.draw(ALPHABET)]
                    else:
                        self.pool.allocate(rid, toks, n)
                except (OutOfBlocks, ExceedsCapacity):
                    continue
            elif op == "truncate":  # a verification that rejected some drafts
                truncate(self.pool, rid, data.draw(st.integers(0, pool_stored(self.pool, rid))))
            elif op == "fork":
                fork(self.pool, rid, f"tx{k}")
                live.add(f"tx{k}")
            else:
                self.pool.free(rid)
                live.discard(rid)
            did[op] += 1

    # -------------------------------------------------------------- invariants
    @invariant()
    def pool_matches_model_and_spec(self) -> None:
        if not hasattr(self, "pool"):
            return
        snap = self.pool.snapshot()
        assert snap == self.model.snapshot()
        assert check_pool(snap) == []

    @invariant()
    def events_replay_to_the_index(self) -> None:
        """EVENTS: the last state's index plus the events published since is this one."""
        if not hasattr(self, "pool"):
            return
        log = self.pool.cache_events
        assert log is not None
        events = log.drain()
        snap = self.pool.snapshot()
        assert check_events(self.replica, events, self.next_seq, snap) == []
        if events:
            event("cache events published")
        self.replica = snap.cache_entries
        self.next_seq += len(events)

    @invariant()
    def own_accounting(self) -> None:
        if not hasattr(self, "pool"):
            return
        snap = self.pool.snapshot()
        bs = self.bs
        assert sorted(t.request_id for t in snap.tables) == sorted(self.stored)
        holders = self._holders()
        assert snap.ref_cnt == tuple(holders[b] for b in range(self.num_blocks))
        assert len(set(snap.free_queue)) == len(snap.free_queue)
        assert set(snap.free_queue) == set(range(self.num_blocks)) - set(holders)
        assert self.pool.num_free_blocks == self.num_blocks - len(holders)
        logical: dict[int, list[tuple[str, int]]] = {}
        for t in snap.tables:
            tokens = self.stored[t.request_id]
            assert list(t.token_ids) == tokens
            assert t.num_stored == len(tokens)
            assert len(t.block_table) == blocks_needed(len(tokens), bs)
            assert t.root_key == self.ns[t.request_id].root_key()
            for i, b in enumerate(t.block_table):
                logical.setdefault(b, []).append((t.request_id, i))
            # Fake KV memory: the request reads back exactly its own tokens.
            got = [
                self.memory.get(slot_of(t.block_table[p // bs], p, bs)) for p in range(len(tokens))
            ]
            assert got == tokens, f"request {t.request_id} reads {got}, owns {tokens}"
        # A physical block is shared only at one logical index, in one namespace, under
        # an identical prefix up to the shorter fill of that block.
        for b, users in logical.items():
            (r0, i0), rest = users[0], users[1:]
            for r, i in rest:
                assert i == i0, f"block {b} at logical {i0} in {r0} and {i} in {r}"
                assert self.ns[r] == self.ns[r0]
                end = min(len(self.stored[r]), len(self.stored[r0]), (i + 1) * bs)
                assert self.stored[r][:end] == self.stored[r0][:end]
        # White-box: the chain keys a table keeps for its full blocks (not in the snapshot,
        # so a rollback that forgets them passes snapshot equality) match its tokens.
        for rid, tokens in self.stored.items():
            keys = self.pool.tables.table(rid, "keys").keys
            full = len(tokens) // bs if self.caching else 0  # kept only with caching on
            want = chain_keys(self.ns[rid].root_key(), tokens, bs, full)
            assert keys == want, f"request {rid}: stale chain keys"
        for e in snap.cache_entries:
            assert len(e.token_ids) == bs
            contents = [self.memory.get(slot_of(e.block_id, p, bs)) for p in range(bs)]
            assert contents == list(e.token_ids), f"cache entry of block {e.block_id} is stale"


# At least 200 examples x 50 steps; a larger profile (HYPOTHESIS_PROFILE=deep) raises both.
_profile = settings.default
assert _profile is not None
PoolMachine.TestCase.settings = settings(
    max_examples=max(200, _profile.max_examples),
    stateful_step_count=max(50, _profile.stateful_step_count),
)
TestPoolStateMachine = PoolMachine.TestCase
