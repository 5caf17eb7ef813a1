"""The KV level's executor: a fake KV memory (slot -> token id) that performs the copies a
manager returns, then writes each new position's token at its slot through the
*returned* table, so a copy-on-write done but not reported, or a block released while
still held, shows on read-back (:func:`refserve.conformance.kv.checks.read_back_violations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refserve.spec.arith import slot_of
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace
from refserve.spec.snapshot import PoolSnapshot
from refserve.spec.violation import Invariant, Violation, violation


@dataclass(frozen=True)
class Written:
    """What executing one allocation broke; ``stop``: the memory cannot follow (a copy
    named a block out of range), so the run ends."""

    violations: list[Violation] = field(default_factory=list)
    stop: bool = False


class FakeKVMemory:
    """The token id at every written slot, and the key namespace that computed it
    (feature ``key_domains``; absent: the default one)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.slots: dict[int, int] = {}
        self.writers: dict[int, Namespace] = {}

    def clone(self) -> FakeKVMemory:
        new = FakeKVMemory(self.bs)
        new.slots, new.writers = dict(self.slots), dict(self.writers)
        return new

    def execute(
        self,
        rid: str,
        known: tuple[int, ...],
        table: tuple[int, ...],
        copies: tuple[tuple[int, int], ...],
        span: range,
        after: PoolSnapshot,
        namespace: Namespace,
    ) -> Written:
        """The returned copies, then the token of each position in ``span`` at its slot
        through the returned table (POS: the table covers the positions; PREFIX: written
        blocks are private to the writer, i.e. copy-on-write happened)."""
        nb, who = after.num_blocks, f"request {rid}"
        for src, dst in copies:
            if not (0 <= src < nb and 0 <= dst < nb):
                v = violation(
                    Invariant.BLOCK,
                    who,
                    "copy names a block out of range",
                    f"0..{nb - 1}",
                    (src, dst),
                )
                return Written([v], stop=True)
            self.copy_block(src, dst)
        out: list[Violation] = []
        written = self.write(who, known, table, span, nb, namespace, out)
        for b in sorted(written):
            if after.ref_cnt[b] > 1:
                out.append(
                    violation(
                        Invariant.PREFIX,
                        who,
                        f"writes into block {b} shared by several requests",
                        "ref_cnt 1 (copy-on-write)",
                        after.ref_cnt[b],
                    )
                )
                break
        return Written(out)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.bs
        for off in range(bs):
            v = self.slots.get(src * bs + off)
            w = self.writers.get(src * bs + off)
            if v is None:
                self.slots.pop(dst * bs + off, None)
            else:
                self.slots[dst * bs + off] = v
            if w is None:
                self.writers.pop(dst * bs + off, None)
            else:
                self.writers[dst * bs + off] = w

    def write(
        self,
        who: str,
        known: tuple[int, ...],
        table: tuple[int, ...],
        span: range,
        nb: int,
        namespace: Namespace,
        out: list[Violation],
    ) -> set[int]:
        """Write ``span``'s tokens through ``table`` up to the first position it cannot
        place (a violation in ``out``); the blocks written."""
        bs = self.bs
        written: set[int] = set()
        for p in span:
            idx = p // bs
            if idx >= len(table):
                out.append(
                    violation(
                        Invariant.POS,
                        who,
                        f"position {p} lies beyond the returned block table",
                        f"< {len(table) * bs}",
                        p,
                    )
                )
                break
            b = table[idx]
            if not 0 <= b < nb:
                out.append(
                    violation(
                        Invariant.BLOCK,
                        who,
                        "returned block table names a block out of range",
                        f"0..{nb - 1}",
                        b,
                    )
                )
                break
            slot = slot_of(b, p, bs)
            self.slots[slot] = known[p]
            if namespace == DEFAULT_NAMESPACE:
                self.writers.pop(slot, None)
            else:
                self.writers[slot] = namespace
            written.add(b)
        return written


__all__ = ["FakeKVMemory", "Written"]
