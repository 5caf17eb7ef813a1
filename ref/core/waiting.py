"""The waiting queue, kept in admission order as requests come and go.

Admission reads the queue from its head and stops at the first request that does not fit
(FCFS), so a step should cost what it admits, not what waits. Sorting the whole queue
every step made a backlog of n requests cost O(n log n) per step; this queue keeps
admission's order incrementally instead:

* Order. A request's place is ``(effective priority, seq, recency)``: priority as the
  policy ages it (``DecodeFirst.effective_priority``), then arrival order, then, between
  requests sharing a ``seq`` (a fork and its parent), the one queued last first. That is
  exactly the order the scheduler's former list gave (sorted by seq, a requeued request
  inserted ahead of its equal-seq siblings) after a stable sort by effective priority.
* Aging without re-sorting. The effective priority is
  ``priority - (step - queued_step) // aging_steps``. Write ``queued_step = k*A + phase``
  with ``A = aging_steps`` and ``0 <= phase < A``: then it is
  ``(priority + k) - (step - phase) // A``. The first term is fixed at queueing time and
  the second is shared by every request of the same phase, so within one phase the order
  never changes as steps pass. Each phase is a heap on the fixed key; at a step the heads
  of at most ``A`` phase heaps are merged with their current offsets. Without aging there
  is one phase and the key is the priority.
* Tenants. A policy ordering tenants first (deficit round robin) keeps one set of phase
  heaps per tenant and merges them by its per-tenant rank, read at the step.
* Reading in order. :meth:`WaitingQueue.ordered` walks the heaps lazily (a frontier heap
  over heap positions), so reading the first k requests costs ``O((s + k) log(s + k))``
  for ``s`` heaps, whatever the queue length, and changes nothing: a plan that is rolled
  back leaves the queue as it was. A pass can leave out a whole tenant
  (:meth:`WaitingReader.skip_tenant`: tenant-fair's running cap), so a capped tenant's
  backlog is not read request by request.
* Cost with aging: a step merges one heap per phase present (at most ``aging_steps``,
  times the tenants for tenant-fair), so its fixed cost is that many heap heads.
* Removal (admission, timeout, abort) is lazy: the request's entry stays in its heap,
  marked stale, and is popped when it reaches the top; a heap that is more than half
  stale is rebuilt. Both are O(log n) amortized per removal.
* Timeouts. Requests that were never admitted are also kept in a heap by arrival time, so
  the overdue ones are found without scanning the queue (:meth:`WaitingQueue.overdue`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from refserve.core.request import Request


@dataclass(frozen=True)
class _HeapKey:
    tenant: str  # "" unless the queue is split by tenant
    phase: int  # queued_step mod aging_steps; 0 without aging


class _Entry(NamedTuple):
    """A request's place in its phase heap. A NamedTuple, not a dataclass: heap
    comparisons then run at C speed. ``recency`` is unique, so ``request`` is never
    compared."""

    rank: int  # priority, plus queued_step // aging_steps with aging
    seq: int
    recency: int  # minus the queueing counter: later queueing sorts first within a seq
    request: Request
    heap: _HeapKey
    timed: bool  # also in the arrival heap (never admitted, timeouts on)


class _Arrival(NamedTuple):
    """A never-admitted request in arrival order, for the queue timeout."""

    arrival_ms: float
    recency: int
    request: Request


@dataclass
class _Heap:
    entries: list[_Entry] = field(default_factory=list)
    stale: int = 0  # entries of requests no longer queued (or queued again elsewhere)


class WaitingQueue:
    """Waiting requests in admission order; see the module docstring for the design."""

    def __init__(
        self,
        aging_steps: int = 0,
        *,
        by_tenant: bool = False,
        track_arrivals: bool = False,
        group: Callable[[Request], str] | None = None,
    ) -> None:
        """``by_tenant`` splits the queue by tenant, ``group`` by any key a policy gives
        each request when it is queued (the multi-level queue's level): either way the
        order reads the split's rank first (:meth:`ordered`'s ``tenant_rank``)."""
        assert aging_steps >= 0
        assert not (by_tenant and group), "one split: by tenant or by group"
        self.aging_steps = aging_steps
        self.by_tenant = by_tenant or group is not None
        self._group = group
        self._heaps: dict[_HeapKey, _Heap] = {}
        self._live: dict[str, _Entry] = {}  # request id -> its current entry
        self._counter = 0  # queueings so far; also what ordered() checks for changes
        # Only kept when the scheduler has a queue timeout to apply.
        self._arrivals: list[_Arrival] | None = [] if track_arrivals else None
        self._arrivals_stale = 0

    # ------------------------------------------------------------------ contents
    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    @property
    def version(self) -> tuple[int, int]:
        """Changes when the queue does (queueings so far, length): a reader's check."""
        return self._counter, len(self._live)

    def __contains__(self, r: object) -> bool:
        if not isinstance(r, Request):
            return False
        live = self._live.get(r.request_id)
        return live is not None and live.request is r

    def __iter__(self) -> Iterator[Request]:
        """Arrival order (seq; a requeued request ahead of its equal-seq siblings).
        O(n log n): for inspection and tests, never on a step's path."""
        entries = sorted(self._live.values(), key=lambda e: (e.seq, e.recency))
        return iter([e.request for e in entries])

    # ------------------------------------------------------------------ changes
    def add(self, r: Request) -> None:
        """Queue ``r`` at the place its priority, ``seq`` and ``queued_step`` give it."""
        rid = r.request_id
        assert rid not in self._live, f"{rid!r} is already waiting"
        self._counter += 1
        recency = -self._counter
        if self.aging_steps:
            levels, phase = divmod(r.queued_step, self.aging_steps)
        else:
            levels, phase = 0, 0
        tenant = r.tenant if self.by_tenant else ""
        key = _HeapKey(self._group(r) if self._group is not None else tenant, phase)
        # A NaN arrival never times out (every comparison is false) and would break the
        # heap's order, so it is not tracked.
        timed = (
            self._arrivals is not None and r.admitted_ms is None and r.arrival_ms == r.arrival_ms
        )
        entry = _Entry(r.priority + levels, r.seq, recency, r, key, timed)
        heap = self._heaps.get(key)
        if heap is None:
            heap = self._heaps[key] = _Heap()
        heapq.heappush(heap.entries, entry)
        self._live[rid] = entry
        if timed:
            assert self._arrivals is not None
            heapq.heappush(self._arrivals, _Arrival(r.arrival_ms, recency, r))

    def remove(self, r: Request) -> None:
        """Take ``r`` out of the queue (admitted, timed out, aborted)."""
        entry = self._live.pop(r.request_id)
        assert entry.request is r
        heap = self._heaps[entry.heap]
        heap.stale += 1
        if heap.stale == len(heap.entries):
            del self._heaps[entry.heap]  # nothing live left in it
        else:
            self._tidy(heap)
        if entry.timed:
            self._arrivals_stale += 1
            self._tidy_arrivals()

    def is_live(self, request: Request, recency: int) -> bool:
        """True if the heap entry of ``request`` with ``recency`` is its current one."""
        live = self._live.get(request.request_id)
        return live is not None and live.recency == recency

    def _tidy(self, heap: _Heap) -> None:
        # Stale entries at the top go now (admission removes the head, so that is where
        # they usually are); elsewhere they wait until they are half the heap.
        entries = heap.entries
        while entries and not self.is_live(entries[0].request, entries[0].recency):
            heapq.heappop(entries)
            heap.stale -= 1
        if heap.stale * 2 > len(entries):
            entries[:] = [e for e in entries if self.is_live(e.request, e.recency)]
            heapq.heapify(entries)
            heap.stale = 0
        assert heap.stale >= 0

    def _tidy_arrivals(self) -> None:
        arrivals = self._arrivals
        assert arrivals is not None
        while arrivals and not self.is_live(arrivals[0].request, arrivals[0].recency):
            heapq.heappop(arrivals)
            self._arrivals_stale -= 1
        if self._arrivals_stale * 2 > len(arrivals):
            arrivals[:] = [a for a in arrivals if self.is_live(a.request, a.recency)]
            heapq.heapify(arrivals)
            self._arrivals_stale = 0
        assert self._arrivals_stale >= 0

    # ------------------------------------------------------------------ reading
    def ordered(
        self, step_index: int, tenant_rank: Callable[[str], float] | None = None
    ) -> WaitingReader:
        """Requests in admission order at ``step_index``, produced lazily.

        The order is ``(tenant_rank(tenant), effective priority, seq, recency)``; without
        ``tenant_rank`` the first term is left out. The queue must not change while the
        reader is read (admission only reads; removals happen at commit).
        """
        assert tenant_rank is None or self.by_tenant, "tenant order needs a by_tenant queue"
        frontier: list[_Frontier] = []
        for key, heap in self._heaps.items():
            entries = heap.entries
            trank = tenant_rank(key.tenant) if tenant_rank is not None else 0.0
            offset = (step_index - key.phase) // self.aging_steps if self.aging_steps else 0
            e = entries[0]
            frontier.append(
                _Frontier(trank, e.rank - offset, e.seq, e.recency, entries, offset, 0, key.tenant)
            )
        heapq.heapify(frontier)
        return WaitingReader(self, frontier)

    def overdue(self, now_ms: float, timeout_ms: float) -> list[Request]:
        """Never-admitted requests with ``now_ms - arrival_ms > timeout_ms``, in arrival
        order (seq). Reads only the overdue ones and the stale entries among them."""
        arrivals = self._arrivals
        assert arrivals is not None, "overdue needs a queue built with track_arrivals"
        found: list[_Arrival] = []
        # The arrival heap is walked in order (as in ordered()); "overdue" is monotone in
        # arrival time, so the walk stops at the first arrival that is not.
        frontier: list[tuple[float, int, int]] = []
        if arrivals:
            frontier.append((arrivals[0].arrival_ms, arrivals[0].recency, 0))
        while frontier:
            arrival_ms, _, i = heapq.heappop(frontier)
            if not now_ms - arrival_ms > timeout_ms:
                break
            a = arrivals[i]
            if self.is_live(a.request, a.recency) and a.request.admitted_ms is None:
                found.append(a)
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(arrivals):
                    heapq.heappush(frontier, (arrivals[c].arrival_ms, arrivals[c].recency, c))
        found.sort(key=lambda a: (a.request.seq, a.recency))
        return [a.request for a in found]


class _Frontier(NamedTuple):
    """A heap position the reader may yield next, keyed by its place in the order
    (``recency`` is unique, so the fields after it are never compared)."""

    tenant_rank: float
    effective_priority: int
    seq: int
    recency: int
    entries: list[_Entry]
    offset: int  # the aging offset of this heap's phase at the step read
    position: int
    tenant: str


class WaitingReader:
    """One admission pass over a :class:`WaitingQueue`, in order, read lazily.

    It walks the heaps through a frontier of heap positions (a heap's children are
    pushed when their parent is read), so reading k requests costs
    ``O((s + k) log(s + k))`` for ``s`` heaps, whatever the queue length.
    """

    def __init__(self, queue: WaitingQueue, frontier: list[_Frontier]) -> None:
        self._queue = queue
        self._frontier = frontier
        self._version = queue.version
        self._skipped: set[str] = set()

    def __iter__(self) -> WaitingReader:
        return self

    def __next__(self) -> Request:
        queue, frontier = self._queue, self._frontier
        while frontier:
            # A change under a reader would walk a heap whose positions moved.
            assert queue.version == self._version, "queue changed while read"
            f = heapq.heappop(frontier)
            if f.tenant in self._skipped:
                continue  # nor its children: the whole tenant is left out
            entries, offset, i = f.entries, f.offset, f.position
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(entries):
                    e = entries[c]
                    heapq.heappush(
                        frontier,
                        _Frontier(
                            f.tenant_rank,
                            e.rank - offset,
                            e.seq,
                            e.recency,
                            entries,
                            offset,
                            c,
                            f.tenant,
                        ),
                    )
            e = entries[i]
            if queue.is_live(e.request, f.recency):
                return e.request
        raise StopIteration

    def skip_tenant(self, tenant: str) -> None:
        """Read no more requests of ``tenant`` in this pass (a by-tenant queue; e.g. the
        tenant is at its running cap, which admission cannot lower)."""
        assert self._queue.by_tenant, "tenants are only told apart in a by_tenant queue"
        self._skipped.add(tenant)
