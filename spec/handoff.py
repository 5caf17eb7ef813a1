"""MOVED, rule ``handoff``: a move sends and receives through the two tables as they are.

Why it matters: a K/V hand-off between engines (a prefill/decode pair, a migration) is
described by two slot lists, the one the sender reads and the one the receiver writes.
They are computed from the engines' tables, at some moment, by code of their own. A list
computed before a preemption on the sending side and sent after it names blocks the
request no longer holds: they were freed, perhaps handed to another request, and the
receiver loads whatever they hold now; an empty list for a request that has K/V leaves
the receiver with nothing to load; a receiver that receives into slots its table does
not map the positions to loads K/V its reads never see, or overwrites someone else's. The other
migration rules see such a list only through its effect: KVCOPY when a stale slot's
content has already changed, MOVED when the source holds no table at all. A stale slot
whose old content is still there (freed, not yet reused) passes both, and the next
reuse of the block corrupts the receiver's K/V after the move was checked.

The rule, on every transit of a :class:`~refserve.spec.cluster.ClusterSnapshot` whose
lists were recorded (:attr:`Transit.sent_slots`, :attr:`Transit.received_slots`):

* the sender, while it still holds the request: the slots it sends are exactly the
  slots its table holds for the request's KV length (``slot_of(table[p // bs], p, bs)``
  for every position ``p < num_stored``, on the host pool for a request swapped out
  there): none missing (an empty or short list for a request with K/V), none extra and
  none of a block the table no longer holds;
* the receiver, once staged with K/V: the slots it receives into are exactly its staged
  table's slots for the positions after its prefix hit up to the sender's KV length
  (none missing, none extra, none outside the table). How many blocks that table holds
  is POS's (checked on the staged pool: the blocks covering the K/V, plus the declared
  lookahead at most), and that it holds the sender's KV length and positions is MOVED's.
"""

from __future__ import annotations

from refserve.spec.arith import slot_of
from refserve.spec.cluster import ClusterSnapshot, Node, Transit
from refserve.spec.snapshot import TableSnapshot
from refserve.spec.violation import Invariant, Violation, violation

M = Invariant.MOVED

#: The rule's name in a :class:`Violation`.
HANDOFF = "handoff"


def table_slots(table: TableSnapshot, first: int, last: int, block_size: int) -> tuple[int, ...]:
    """The slots ``table`` maps positions ``[first, last)`` to; -1 where it has no block."""
    out = []
    for p in range(first, last):
        i = p // block_size
        out.append(
            slot_of(table.block_table[i], p, block_size) if i < len(table.block_table) else -1
        )
    return tuple(out)


def check_handoff(snap: ClusterSnapshot) -> list[Violation]:
    """Both slot lists of every recorded transit against the tables (module doc)."""
    out: list[Violation] = []
    for t in snap.transits:
        src = snap.node(t.source)
        if t.sent_slots is not None and src is not None and t.phase.source_holds:
            out.extend(_check_sender(src, t, t.sent_slots))
        dst = snap.node(t.destination)
        if t.received_slots is not None and dst is not None and t.moves_kv:
            out.extend(_check_receiver(dst, t, t.received_slots))
    return out


def _check_sender(src: Node, t: Transit, sent: tuple[int, ...]) -> list[Violation]:
    who = f"request {t.request_id}"
    device = src.engine.pool.table(t.request_id)
    host = None if src.engine.host is None else src.engine.host.table(t.request_id)
    table = host if t.sent_on_host else device
    pool = src.engine.host if t.sent_on_host and src.engine.host is not None else src.engine.pool
    where = "host" if t.sent_on_host else "device"
    if not sent:
        held = max((x.num_stored for x in (device, host) if x is not None), default=0)
        if held == 0:
            return []
        return [
            violation(
                M,
                who,
                f"its source {t.source} sends an empty slot list for a request with K/V",
                f"{held} slots",
                "none",
                rule=HANDOFF,
            )
        ]
    if table is None:
        return [
            violation(
                M,
                who,
                f"its source {t.source} sends {len(sent)} {where} slots from no table "
                "(a list from before the request lost its blocks)",
                "no slots",
                sent,
                rule=HANDOFF,
            )
        ]
    want = table_slots(table, 0, table.num_stored, pool.block_size)
    if sent == want:
        return []
    stale = [s for s in sent if s not in want]
    return [
        violation(
            M,
            who,
            f"its source {t.source} sends other slots than its {where} table holds for its "
            f"KV length {table.num_stored}"
            + (f" (slots {stale[:4]} of blocks it no longer holds)" if stale else ""),
            want,
            sent,
            rule=HANDOFF,
        )
    ]


def _check_receiver(dst: Node, t: Transit, received: tuple[int, ...]) -> list[Violation]:
    who = f"request {t.request_id}"
    table = dst.engine.pool.table(t.request_id)
    if table is None:
        return []  # nothing staged: LEAK's finding (the transit's blocks are missing)
    bs = dst.engine.pool.block_size
    out: list[Violation] = []
    want = table_slots(table, t.num_hit_tokens, t.kv_length, bs)
    if received != want:
        out.append(
            violation(
                M,
                who,
                f"{t.destination} receives into other slots than its staged table holds "
                f"for positions {t.num_hit_tokens}..{t.kv_length - 1}",
                want,
                received,
                rule=HANDOFF,
            )
        )
    return out
