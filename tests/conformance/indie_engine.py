"""indie: a second, deliberately different little serving engine for the conformance suite.

It shares no code with ``ref/`` (nothing is imported from it), so that the suite is held
against design choices nobody here made for it.
Where it differs from refserve on purpose:

* **Free list**: a LIFO stack of block ids (the block freed last is handed out first),
  not an LRU queue. Freed cached blocks keep their index entry until the stack hands
  them out again.
* **Prefix cache**: full blocks are indexed by ``hash((parent hash, tokens))`` and
  :meth:`BlockManager.lookup` trusts the index without re-reading the block, so dropping
  an entry when its block is reused is what keeps it correct. The scheduler never calls
  ``lookup`` (no prefix caching for new requests); a KV-level driver does, and so does
  an import when migration is on (``import_hits``).
* **Migration** (:meth:`IndieEngine.export`, :meth:`~IndieEngine.stage`, ...): an import
  checkpoints the whole block manager and restores it on abort (no journal); it takes
  the destination's own prefix hit; an imported request joins as the latest arrival
  (end of the waiting queue, or running with its K/V). ``recompute_imports`` makes an
  engine that never takes K/V: every import recomputes, a correct choice too.
* **Slots reserved one ahead**: a chunk that reaches the end of the known tokens also
  reserves the slot of the token it will sample, so between steps a sampled request
  holds ``ceil((kv_len + 1) / block_size)`` blocks. A decode therefore needs a new
  block one token earlier than in refserve, and a lone request is finished for
  ``capacity`` one token earlier too.
* **Fused step**: :meth:`IndieEngine.step` is one generator that plans, yields the batch
  to the model runner, receives the sampled tokens and commits. Planning mutates the
  block manager at once; there is no journal, so a planned step cannot be undone.
* **Prefill-first**: running prefills, then admission, then decodes share the budget,
  in that order.
* **Preemption by recompute, latest arrival first**: the victim frees all its blocks
  and goes back to the *front* of the waiting queue; no one is admitted in a step that
  preempted.
* **No eos handling**: a request stops only at ``max_tokens`` (or ``max_model_len``).
* **Admission**: FCFS with head-of-line blocking (declared ``fcfs_strict``); a waiting
  request is admitted when the free blocks cover its first chunk (plus the slot ahead if
  that chunk samples), and a head that does not fit holds back everyone behind it.
* **Unchunked** (``chunked=False``): a prompt is prefilled whole or waits; admission then
  also wants the whole sequence (a recomputed one with its outputs) within the budget
  left in the step, and a sequence longer than the whole budget is finished for
  ``capacity``, since no step can ever hold it.

``bug`` plants one realistic mistake (:data:`BUGS`) so tests can check the suite sees it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

BUGS = frozenset(
    {
        "cow_skipped",  # fork's copy-on-write of a shared partial block is skipped
        "fork_no_incref",  # fork shares blocks without taking a reference
        "budget_overrun",  # the decode loop runs one token past the budget
        "fcfs_broken",  # new arrivals are queued at the front (LIFO admission)
        "preempt_keeps_blocks",  # a preempted request keeps its blocks
        "blocks_needed_off_by_one",  # a block too many when tokens end on a block boundary
        "abort_leak",  # abort of a running request does not free its blocks
        "stale_prefix_entry",  # a reused block keeps its old prefix-cache entry
        "preempt_no_reset",  # a preempted request keeps its KV length
        "capacity_spin",  # a lone request that can never grow is skipped, not finished
        "hol_skip",  # a later request that fits is admitted past a head that does not
    }
)

UNCHUNKED_BUGS = frozenset(
    {
        # Admission wants the whole sequence strictly below the budget left, so a sequence
        # exactly as long as the whole budget waits forever (and holds the queue).
        "whole_prompt_off_by_one",
    }
)
"""Bugs of the unchunked engine's admission (``chunked=False``), planted like :data:`BUGS`."""

MIGRATION_BUGS = frozenset(
    {
        "wrong_block_sent",  # the export sends every block after the first from the one before
        "free_before_ack",  # the export frees the request's blocks before the destination's ack
        "hit_counted_twice",  # an import counts the destination's prefix hit twice in its KV
    }
)
"""Bugs of the migration code (feature ``migration``), planted like :data:`BUGS`."""


class EngineError(Exception):
    """The engine refuses a request (bad input, or it can never fit)."""


class OutOfBlocks(Exception):
    """Not enough free blocks right now; the block manager changed nothing."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- KV blocks
@dataclass(frozen=True)
class Reservation:
    """What an allocation did: the whole table, the copies to run before writing."""

    table: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]
    cached_tokens: int = 0
    """Tokens served from the prefix cache (first allocation only)."""


class _Table:
    """One sequence's blocks and the token ids whose KV they hold (mutable state)."""

    __slots__ = ("blocks", "hashes", "tokens")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.tokens: list[int] = []  # KV length == len(tokens)
        self.hashes: list[int] = []  # chain hash of each full block, in table order


class BlockManager:
    """Paged KV blocks: a LIFO free stack, ref counts, copy-on-write and a prefix index."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool = False,
        bug: str | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise EngineError(f"bad pool shape {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.bug = bug
        self.ref = [0] * num_blocks
        # Top of the stack is the end of the list; block 0 is handed out first.
        self.free_stack = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, _Table] = {}
        self.index: dict[int, int] = {}  # chain hash -> block
        self.key_of: dict[int, int] = {}  # block -> its chain hash in the index

    @property
    def num_free(self) -> int:
        return len(self.free_stack)

    def blocks_for(self, num_slots: int) -> int:
        if self.bug == "blocks_needed_off_by_one":
            return (num_slots + self.block_size) // self.block_size
        return _cdiv(num_slots, self.block_size)

    def num_stored(self, seq_id: str) -> int:
        t = self.tables.get(seq_id)
        return len(t.tokens) if t is not None else 0

    def table(self, seq_id: str) -> tuple[int, ...]:
        return tuple(self.tables[seq_id].blocks)

    def lookup(self, token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """Cached blocks holding the first full blocks of ``token_ids`` (at most
        ``max_blocks``), found by chain hash alone."""
        bs = self.block_size
        hits: list[int] = []
        parent = 0
        if not self.prefix_caching:
            return hits
        for i in range(min(max_blocks, len(token_ids) // bs)):
            h = hash((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            b = self.index.get(h)
            if b is None:
                break
            hits.append(b)
            parent = h
        return hits

    def _plan(
        self, seq_id: str, num_new: int, lookahead: int, hit: Sequence[int]
    ) -> tuple[int, int, list[int]]:
        """(blocks the table will hold, free blocks consumed, table indices to copy)."""
        t = self.tables.get(seq_id)
        if t is None:
            total = self.blocks_for(len(hit) * self.block_size + num_new + lookahead)
            revived = sum(1 for b in hit if self.ref[b] == 0)
            return total, max(0, total - len(hit)) + revived, []
        stored = len(t.tokens)
        total = max(len(t.blocks), self.blocks_for(stored + num_new + lookahead))
        # A block about to be written that someone else also reads gets a private copy.
        written = range(
            stored // self.block_size, min(len(t.blocks), _cdiv(stored + num_new, self.block_size))
        )
        cow = [i for i in written if self.ref[t.blocks[i]] > 1]
        if self.bug == "cow_skipped":
            cow = []
        return total, total - len(t.blocks) + len(cow), cow

    def blocks_to_allocate(self, seq_id: str, num_new: int, lookahead: int = 0) -> int:
        return self._plan(seq_id, num_new, lookahead, ())[1]

    def allocate(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_new: int,
        *,
        lookahead: int = 0,
        hit: Sequence[int] = (),
    ) -> Reservation:
        """A new sequence's first blocks: ``hit`` (from :meth:`lookup`) then room for
        ``num_new`` tokens plus ``lookahead`` reserved slots. All or nothing."""
        if seq_id in self.tables:
            raise EngineError(f"allocate: {seq_id!r} already holds blocks")
        return self._reserve(seq_id, token_ids, num_new, lookahead, hit)

    def append(
        self, seq_id: str, token_ids: Sequence[int], num_new: int, *, lookahead: int = 0
    ) -> Reservation:
        """Room for ``num_new`` more tokens of a sequence holding blocks (plus
        ``lookahead`` reserved slots), copying any shared block it writes. All or nothing."""
        if seq_id not in self.tables:
            raise EngineError(f"append: {seq_id!r} holds no blocks")
        return self._reserve(seq_id, token_ids, num_new, lookahead, ())

    def _reserve(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_new: int,
        lookahead: int,
        hit: Sequence[int],
    ) -> Reservation:
        total, need, cow = self._plan(seq_id, num_new, lookahead, hit)
        if need > len(self.free_stack):
            raise OutOfBlocks(f"{seq_id}: needs {need} blocks, {len(self.free_stack)} free")
        t = self.tables.get(seq_id)
        if t is None:
            t = self.tables[seq_id] = _Table()
            for b in hit:
                if self.ref[b] == 0:
                    self.free_stack.remove(b)  # revived from the free stack, entry kept
                self.ref[b] += 1
                t.blocks.append(b)
                t.hashes.append(self.key_of[b])
            t.tokens.extend(token_ids[: len(hit) * self.block_size])
        copies: list[tuple[int, int]] = []
        for i in cow:
            src, dst = t.blocks[i], self._pop_free()
            self.ref[src] -= 1
            self.ref[dst] = 1
            t.blocks[i] = dst
            copies.append((src, dst))
        while len(t.blocks) < total:
            b = self._pop_free()
            self.ref[b] = 1
            t.blocks.append(b)
        start = len(t.tokens)
        t.tokens.extend(token_ids[start : start + num_new])
        self._index_full_blocks(t)
        return Reservation(tuple(t.blocks), tuple(copies), len(hit) * self.block_size)

    def allocate_cached(
        self, seq_id: str, token_ids: Sequence[int], num_new: int, *, lookahead: int = 0
    ) -> Reservation:
        """:meth:`allocate` through the prefix cache: the longest cached prefix that leaves
        ``num_new`` known tokens to compute, shortened while reviving it would take more
        free blocks than there are (a hit stores more KV than a miss, so a miss may fit
        where the whole hit does not)."""
        hit = self.lookup(token_ids, (len(token_ids) - num_new) // self.block_size)
        while hit and self._plan(seq_id, num_new, lookahead, hit)[1] > len(self.free_stack):
            hit.pop()
        return self.allocate(seq_id, token_ids, num_new, lookahead=lookahead, hit=hit)

    def fork(self, parent: str, child: str) -> None:
        """The child shares every block; the first write to a shared block copies it."""
        p = self.tables[parent]
        if child in self.tables:
            raise EngineError(f"fork: {child!r} already holds blocks")
        c = self.tables[child] = _Table()
        c.blocks, c.tokens, c.hashes = list(p.blocks), list(p.tokens), list(p.hashes)
        if self.bug != "fork_no_incref":
            for b in c.blocks:
                self.ref[b] += 1

    def free(self, seq_id: str) -> None:
        """Release the blocks, head first: the tail block ends on top of the stack (it is
        the partial one, the least likely to be a cache hit, so it is reused first)."""
        for b in self.tables.pop(seq_id).blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_stack.append(b)

    def checkpoint(self) -> _Checkpoint:
        """A copy of every book, for :meth:`restore` (an aborted import)."""
        tables = {}
        for rid, t in self.tables.items():
            c = tables[rid] = _Table()
            c.blocks, c.tokens, c.hashes = list(t.blocks), list(t.tokens), list(t.hashes)
        return _Checkpoint(
            list(self.ref), list(self.free_stack), tables, dict(self.index), dict(self.key_of)
        )

    def restore(self, cp: _Checkpoint) -> None:
        self.ref, self.free_stack, self.tables = cp.ref, cp.free_stack, cp.tables
        self.index, self.key_of = cp.index, cp.key_of

    def _pop_free(self) -> int:
        b = self.free_stack.pop()
        if b in self.key_of and self.bug != "stale_prefix_entry":
            del self.index[self.key_of.pop(b)]  # the block is about to hold other tokens
        return b

    def _index_full_blocks(self, t: _Table) -> None:
        bs = self.block_size
        for i in range(len(t.hashes), len(t.tokens) // bs):
            parent = t.hashes[-1] if t.hashes else 0
            h = hash((parent, tuple(t.tokens[i * bs : (i + 1) * bs])))
            t.hashes.append(h)
            b = t.blocks[i]
            if self.prefix_caching and h not in self.index and b not in self.key_of:
                self.index[h] = b
                self.key_of[b] = h


# --------------------------------------------------------------------------- requests
class State(Enum):
    QUEUED = "queued"  # never run
    PREFILL = "prefill"
    DECODE = "decode"
    PREEMPTED = "preempted"  # lost its KV, waits to recompute
    DONE = "done"


class Request:
    """One request's mutable state (the engine's own bookkeeping, not a record)."""

    __slots__ = (
        "arrival",
        "computed",
        "max_tokens",
        "num_prompt",
        "reason",
        "rid",
        "state",
        "tokens",
    )

    def __init__(self, rid: str, prompt: Sequence[int], max_tokens: int, arrival: int) -> None:
        self.rid = rid
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.max_tokens = max_tokens
        self.arrival = arrival  # submission order: FCFS and victim choice
        self.computed = 0  # KV length
        self.state = State.QUEUED
        self.reason = ""  # why it is DONE: length, capacity, abort

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclass(frozen=True)
class Chunk:
    """What the model runner gets for one request: positions, slots and its table."""

    rid: str
    positions: tuple[int, ...]
    slots: tuple[int, ...]
    block_table: tuple[int, ...]
    samples: bool


@dataclass(frozen=True)
class Batch:
    chunks: tuple[Chunk, ...]
    preempted: tuple[str, ...]
    retired: tuple[tuple[str, str], ...]
    """(request id, reason) finished while planning (capacity), never scheduled."""
    copies: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StepOutput:
    finished: tuple[tuple[str, str], ...]
    """Every request that finished in the step, with its reason (planning's included)."""


StepGen = Generator[Batch, Mapping[str, int], StepOutput]


@dataclass(frozen=True)
class Ticket:
    """One request as indie hands it to another indie (:meth:`IndieEngine.export`)."""

    rid: str
    tokens: tuple[int, ...]
    num_prompt: int
    max_tokens: int
    slots: tuple[int, ...]
    """The source slot sent for each position of the KV: its length is the KV length."""


@dataclass(frozen=True)
class Landing:
    """What an import reserved (:meth:`IndieEngine.stage`): the prefix hit, and the
    destination slots of the positions after it, which must be written before commit."""

    hit_tokens: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class _Checkpoint:
    ref: list[int]
    free_stack: list[int]
    tables: dict[str, _Table]
    index: dict[int, int]
    key_of: dict[int, int]


class IndieEngine:
    """Requests in, batches out: a waiting deque, a running list and a block manager.

    Drive it with :meth:`step` (a generator: the model runner sits at its ``yield``) or
    :meth:`run_step`; :meth:`add_request` and :meth:`abort` only between steps.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_batched_tokens: int,
        max_seqs: int,
        max_model_len: int = 1 << 20,
        bug: str | None = None,
        import_hits: bool = False,
        recompute_imports: bool = False,
        chunked: bool = True,
    ) -> None:
        if bug is not None and bug not in BUGS | MIGRATION_BUGS | UNCHUNKED_BUGS:
            raise ValueError(f"unknown bug {bug!r}")
        if max_batched_tokens < 1 or max_seqs < 1:
            raise EngineError("the token budget and max_seqs must be >= 1")
        # Only an import looks the cache up: without one, indexing would be wasted.
        self.bm = BlockManager(num_blocks, block_size, prefix_caching=import_hits, bug=bug)
        self.recompute_imports = recompute_imports
        self._landing: tuple[Request, _Checkpoint] | None = None
        self.budget = max_batched_tokens
        self.chunked = chunked
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        self.bug = bug
        self.requests: dict[str, Request] = {}  # live ones
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.outbox: list[Request] = []
        """Requests retired since the current step began (aborts between steps too)."""
        self._arrivals = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, rid: str, prompt: Sequence[int], max_tokens: int) -> None:
        if not rid or rid in self.requests:
            raise EngineError(f"bad or duplicate request id {rid!r}")
        if not prompt:
            raise EngineError(f"{rid}: empty prompt")
        if max_tokens < 1:
            raise EngineError(f"{rid}: max_tokens must be >= 1")
        if len(prompt) >= self.max_model_len:
            raise EngineError(f"{rid}: prompt leaves no room under max_model_len")
        if _cdiv(len(prompt) + 1, self.bm.block_size) > self.bm.num_blocks:
            raise EngineError(f"{rid}: prompt plus its first output can never fit the pool")
        r = Request(rid, prompt, max_tokens, self._arrivals)
        self._arrivals += 1
        self.requests[rid] = r
        if self.bug == "fcfs_broken":
            self.waiting.appendleft(r)
        else:
            self.waiting.append(r)

    def abort(self, rid: str) -> None:
        r = self.requests[rid]
        if r in self.running:
            self.running.remove(r)
            if self.bug != "abort_leak":
                self.bm.free(rid)
        else:
            self.waiting.remove(r)
        self._retire(r, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step
    # ------------------------------------------------------------------ migration
    def export(self, rid: str) -> Ticket:
        """A live request as another indie continues it; changes nothing."""
        r = self._live(rid)
        bs = self.bm.block_size
        n = r.computed if r.state in (State.PREFILL, State.DECODE) else 0
        table = self.bm.table(rid) if n else ()

        def block(p: int) -> int:
            i = p // bs
            if self.bug == "wrong_block_sent" and i > 0:
                i -= 1
            return table[i]

        slots = tuple(block(p) * bs + p % bs for p in range(n))
        if self.bug == "free_before_ack" and n:
            self.bm.free(rid)  # the K/V is "on the wire": the source lets go too early
        return Ticket(rid, tuple(r.tokens), r.num_prompt, r.max_tokens, slots)

    def stage(self, t: Ticket, *, transfer: bool) -> Landing:
        """Reserve the import of ``t``: blocks (its own prefix hit first) for the
        ticket's KV when ``transfer`` (and the engine takes K/V at all), else none. The
        request is not visible until :meth:`commit`. EngineError / OutOfBlocks: nothing
        changed."""
        if self._landing is not None:
            raise EngineError("an import is already staged")
        if t.rid in self.requests:
            raise EngineError(f"import: duplicate request id {t.rid!r}")
        n = len(t.slots) if transfer and not self.recompute_imports else 0
        if not 0 < t.num_prompt <= len(t.tokens) or n >= len(t.tokens):
            raise EngineError(f"import: {t.rid!r}: a ticket with bad lengths")
        if len(t.tokens) >= self.max_model_len:
            raise EngineError(f"import: {t.rid!r} leaves no room under max_model_len")
        bm = self.bm
        if _cdiv(len(t.tokens) + 1, bm.block_size) > bm.num_blocks:
            raise EngineError(f"import: {t.rid!r} can never fit the pool")
        r = Request(t.rid, t.tokens[: t.num_prompt], t.max_tokens, -1)
        r.tokens = list(t.tokens)
        cp = bm.checkpoint()
        if not n:
            r.state = State.PREEMPTED if r.num_outputs else State.QUEUED
            self._landing = (r, cp)
            return Landing(0, ())
        if len(self.running) >= self.max_seqs:
            raise OutOfBlocks(f"import: {t.rid!r}: all {self.max_seqs} running slots taken")
        decoding = r.num_outputs > 0 and n == len(t.tokens) - 1
        hit = bm.lookup(t.tokens, n // bm.block_size)
        hit_tokens = len(hit) * bm.block_size
        res = bm.allocate(t.rid, t.tokens, n - hit_tokens, lookahead=int(decoding), hit=hit)
        r.computed = n + hit_tokens if self.bug == "hit_counted_twice" else n
        r.state = State.DECODE if decoding else State.PREFILL
        bs = bm.block_size
        slots = tuple(res.table[p // bs] * bs + p % bs for p in range(hit_tokens, n))
        self._landing = (r, cp)
        return Landing(hit_tokens, slots)

    def commit(self) -> None:
        """The staged request joins as the latest arrival: running with its K/V, else at
        the end of the waiting queue."""
        r, _ = self._staged()
        self._landing = None
        r.arrival = self._arrivals
        self._arrivals += 1
        self.requests[r.rid] = r
        if r.computed:
            self.running.append(r)
        else:
            self.waiting.append(r)

    def abort_import(self) -> None:
        """Undo the stage: every book as it was."""
        _, cp = self._staged()
        self._landing = None
        self.bm.restore(cp)

    def release(self, rid: str) -> None:
        """The request left for another engine (after its ack): not a finish."""
        r = self._live(rid)
        del self.requests[rid]
        if r in self.running:
            self.running.remove(r)
            if rid in self.bm.tables:  # free_before_ack let go at the export already
                self.bm.free(rid)
        else:
            self.waiting.remove(r)

    def _live(self, rid: str) -> Request:
        r = self.requests.get(rid)
        if r is None:
            raise EngineError(f"request {rid!r} is not live here")
        return r

    def _staged(self) -> tuple[Request, _Checkpoint]:
        if self._landing is None:
            raise EngineError("no import is staged")
        return self._landing

    # ------------------------------------------------------------------ the step
    def step(self) -> StepGen:
        """Plan, hand the batch to the model (``yield``), then commit its tokens."""
        if self._landing is not None:
            raise EngineError("an import is staged: commit or abort it first")
        self.outbox = []
        batch = self._plan()
        sampled = yield batch
        return self._commit(batch, sampled)

    def run_step(self, model: Callable[[Batch], Mapping[str, int]]) -> StepOutput:
        """One whole step with ``model`` as the runner (for callers without a suite)."""
        gen = self.step()
        batch = next(gen)
        try:
            gen.send(model(batch))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]  # the generator's return
        raise RuntimeError("step generator did not finish")

    def _plan(self) -> Batch:
        p = _Planner(self)
        for r in sorted((r for r in self.running if r.state is State.PREFILL), key=_by_arrival):
            if p.left <= 0:
                break
            if r in self.running:  # not a victim of an earlier prefill of this step
                p.grow(r, min(len(r.tokens) - r.computed, p.left))
        if not p.preempted:
            p.admit()
        for r in sorted((r for r in self.running if r.state is State.DECODE), key=_by_arrival):
            if self.bug == "budget_overrun":
                if p.left < 0:
                    break
            elif p.left <= 0:
                break
            if r in self.running:  # not a victim of an earlier decode of this step
                p.grow(r, 1)
        return Batch(tuple(p.chunks), tuple(p.preempted), tuple(p.retired), tuple(p.copies))

    def _commit(self, batch: Batch, sampled: Mapping[str, int]) -> StepOutput:
        finished = list(batch.retired)
        for c in batch.chunks:
            r = self.requests[c.rid]
            r.computed += len(c.positions)
            if not c.samples:
                r.state = State.PREFILL
                continue
            r.tokens.append(sampled[c.rid])
            r.state = State.DECODE
            if r.num_outputs >= r.max_tokens or len(r.tokens) >= self.max_model_len:
                self.running.remove(r)
                self.bm.free(r.rid)
                self._retire(r, "length")
                finished.append((r.rid, "length"))
        return StepOutput(tuple(finished))

    def _retire(self, r: Request, reason: str) -> None:
        r.state = State.DONE
        r.reason = reason
        del self.requests[r.rid]
        self.outbox.append(r)


def _by_arrival(r: Request) -> int:
    return r.arrival


class _Planner:
    """One step's plan under construction; every decision mutates the engine at once."""

    def __init__(self, eng: IndieEngine) -> None:
        self.eng = eng
        self.left = eng.budget
        self.chunks: list[Chunk] = []
        self.scheduled: set[str] = set()
        self.preempted: list[str] = []
        self.retired: list[tuple[str, str]] = []
        self.copies: list[tuple[int, int]] = []

    def lookahead(self, r: Request, n: int) -> int:
        return 1 if r.computed + n == len(r.tokens) else 0

    def grow(self, r: Request, n: int) -> None:
        """Give a running request ``n`` tokens, preempting latest arrivals for room."""
        eng, bm = self.eng, self.eng.bm
        la = self.lookahead(r, n)
        while bm.blocks_to_allocate(r.rid, n, la) > bm.num_free:
            candidates = [x for x in eng.running if x.rid not in self.scheduled]
            victim = max(candidates, key=_by_arrival)
            if victim is r and len(candidates) == 1 and not self.scheduled:
                # Alone with every other block free: it can never grow in this pool.
                if eng.bug == "capacity_spin":
                    return
                eng.running.remove(r)
                bm.free(r.rid)
                eng._retire(r, "capacity")
                self.retired.append((r.rid, "capacity"))
                return
            self.preempt(victim)
            if victim is r:
                return
        self.schedule(r, n, la, new=False)

    def preempt(self, r: Request) -> None:
        eng = self.eng
        eng.running.remove(r)
        if eng.bug != "preempt_keeps_blocks":
            eng.bm.free(r.rid)
        if eng.bug != "preempt_no_reset":
            r.computed = 0
        r.state = State.PREEMPTED
        eng.waiting.appendleft(r)  # back to the front: it recomputes first
        self.preempted.append(r.rid)

    def admit(self) -> None:
        eng, bm = self.eng, self.eng.bm
        skipped = 0  # bug hol_skip: heads left in place, at the front of the queue
        while len(eng.waiting) > skipped and self.left > 0 and len(eng.running) < eng.max_seqs:
            r = eng.waiting[skipped]
            never = not eng.chunked and len(r.tokens) > eng.budget  # no step holds it whole
            if never or _cdiv(len(r.tokens) + 1, bm.block_size) > bm.num_blocks:
                # A preempted request whose outputs outgrew the pool cannot recompute.
                del eng.waiting[skipped]
                eng._retire(r, "capacity")
                self.retired.append((r.rid, "capacity"))
                continue
            n = min(len(r.tokens), self.left)
            if not eng.chunked and not self.whole_fits(len(r.tokens)):
                break  # head-of-line, as below: it waits for a step with room for all of it
            if bm.blocks_to_allocate(r.rid, n, self.lookahead(r, n)) > bm.num_free:
                if eng.bug == "hol_skip":
                    skipped += 1  # looks past a head that does not fit: breaks strict FCFS
                    continue
                break  # head-of-line: nobody overtakes the head of the queue
            del eng.waiting[skipped]
            eng.running.append(r)
            self.schedule(r, n, self.lookahead(r, n), new=True)

    def whole_fits(self, num_tokens: int) -> bool:
        """Unchunked: does a whole sequence of ``num_tokens`` fit the budget left?"""
        if self.eng.bug == "whole_prompt_off_by_one":
            return num_tokens < self.left
        return num_tokens <= self.left

    def schedule(self, r: Request, n: int, la: int, *, new: bool) -> None:
        bm = self.eng.bm
        if new:
            res = bm.allocate(r.rid, r.tokens, n, lookahead=la)
        else:
            res = bm.append(r.rid, r.tokens, n, lookahead=la)
        table = res.table
        bs = bm.block_size
        positions = tuple(range(r.computed, r.computed + n))
        slots = tuple(table[p // bs] * bs + p % bs for p in positions)
        self.copies.extend(res.copies)
        self.chunks.append(Chunk(r.rid, positions, slots, table, r.computed + n == len(r.tokens)))
        self.scheduled.add(r.rid)
        self.left -= n
