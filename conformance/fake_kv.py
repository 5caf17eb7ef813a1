"""The fake KV memory the runner keeps beside the spec (docs/CONFORMANCE.md): a model
check that catches sharing bugs.

Each scheduled slot receives the token id at its position, in the executor's order
(swap-outs, swap-ins, copy-on-write, then the new K/V); the slots of rejected drafts are
poisoned; after each step every request must read back exactly its own tokens through
its block table, on the device and in the host swap pool. A wrong token names the bug
by what it is: never written (POS), a rejected draft's (KVLEN), another request's in a
shared or cached block (PREFIX), or in a private one (BLOCK).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from refserve.conformance.adapter import StepReport
from refserve.spec.arith import slot_of
from refserve.spec.snapshot import EngineSnapshot, TableSnapshot
from refserve.spec.violation import Invariant, Violation, violation

#: A rejected draft's slot in the fake KV memory: never a token id (those are >= 0).
POISONED = -1

#: The tokens each request knows (prompt, then outputs), by request id.
Tokens = Mapping[str, Sequence[int]]


@dataclass
class FakeKV:
    """Slot -> token id, on the device and in the host swap pool."""

    device: dict[int, int] = field(default_factory=dict)
    host: dict[int, int] = field(default_factory=dict)

    def write(
        self,
        plan: StepReport,
        tokens: Tokens,
        proposals: Mapping[str, tuple[int, ...]],
        bs: int,
    ) -> list[Violation]:
        """Execute one step: move the blocks the plan moves, then write each scheduled
        position's token (a verification's drafts after its tokens). POS: a position
        with no known token, the first of each request."""
        for pairs, src_kv, dst_kv in (
            (plan.swap_out, self.device, self.host),
            (plan.swap_in, self.host, self.device),
            (plan.block_copies, self.device, self.device),
        ):
            for src, dst in pairs:
                _copy_block(src_kv, src, dst_kv, dst, bs)
        out: list[Violation] = []
        for s in plan.scheduled:
            toks = list(tokens.get(s.request_id, []))
            if s.num_draft_tokens:  # a verification writes its drafts after its tokens
                toks = [*toks, *proposals.get(s.request_id, ())[: s.num_draft_tokens]]
            for pos, slot in zip(s.positions, s.slot_mapping, strict=False):
                if not 0 <= pos < len(toks):
                    out.append(
                        violation(
                            Invariant.POS,
                            f"request {s.request_id}",
                            f"position {pos} has no known token (num_tokens {len(toks)})",
                        )
                    )
                    break
                self.device[slot] = toks[pos]
        return out

    def poison_rejected(
        self, plan: StepReport, accepted: Mapping[str, int], tokens: Tokens
    ) -> None:
        """The slots of rejected drafts hold K/V no later step may read (KVLEN)."""
        for s in plan.scheduled:
            a = accepted.get(s.request_id)
            if a is None:
                continue
            kept = len(tokens[s.request_id]) + a  # before this step's tokens join
            for pos, slot in zip(s.positions, s.slot_mapping, strict=False):
                if pos >= kept:
                    self.device[slot] = POISONED

    def read_back(self, after: EngineSnapshot, tokens: Tokens) -> list[Violation]:
        """Every request reads exactly its own tokens through its block table."""
        holders: dict[int, int] = defaultdict(int)
        for t in after.pool.tables:
            for b in t.block_table:
                holders[b] += 1
        out: list[Violation] = []
        for t in after.pool.tables:
            toks = tokens.get(t.request_id)
            if toks is None:
                continue
            r = after.request(t.request_id)
            cached = r.num_cached_tokens if r is not None else 0
            v = self._read_back_one(t, toks, after.pool.block_size, holders, cached)
            if v is not None:
                out.append(v)
        return out

    def _read_back_one(
        self,
        t: TableSnapshot,
        toks: Sequence[int],
        bs: int,
        holders: Mapping[int, int],
        cached: int,
    ) -> Violation | None:
        for p in range(min(t.num_stored, len(toks))):
            idx = p // bs
            if idx >= len(t.block_table):
                return None  # POS reports the short table
            b = t.block_table[idx]
            got = self.device.get(slot_of(b, p, bs))
            if got == toks[p]:
                continue
            if got is None:
                inv, why = Invariant.POS, "KV at this position was never written"
            elif got == POISONED:
                inv, why = Invariant.KVLEN, "it holds a rejected draft's K/V"
            elif holders[b] > 1 or p < cached:
                inv, why = (
                    Invariant.PREFIX,
                    f"shared/cached block {b} holds another request's token",
                )
            else:
                inv, why = Invariant.BLOCK, f"block {b} was overwritten by another request"
            who = f"request {t.request_id}"
            return violation(inv, who, f"KV read back at position {p}: {why}", toks[p], got)
        return None

    def read_back_host(self, after: EngineSnapshot, tokens: Tokens) -> list[Violation]:
        """Every host table reads back its request's tokens from the host memory."""
        if after.host is None:
            return []
        bs = after.host.block_size
        out: list[Violation] = []
        for t in after.host.tables:
            toks = tokens.get(t.request_id)
            if toks is None:
                continue
            for p in range(min(t.num_stored, len(toks), len(t.block_table) * bs)):
                got = self.host.get(slot_of(t.block_table[p // bs], p, bs))
                if got != toks[p]:
                    out.append(
                        violation(
                            Invariant.BLOCK,
                            f"request {t.request_id}",
                            f"host KV read back at position {p}: swapped-out K/V lost",
                            toks[p],
                            got,
                        )
                    )
                    break
        return out


def _copy_block(
    src_kv: dict[int, int], src: int, dst_kv: dict[int, int], dst: int, bs: int
) -> None:
    """Block ``src``'s slots onto block ``dst``'s (an unwritten slot stays unwritten)."""
    for off in range(bs):
        v = src_kv.get(src * bs + off)
        if v is None:
            dst_kv.pop(dst * bs + off, None)
        else:
            dst_kv[dst * bs + off] = v
