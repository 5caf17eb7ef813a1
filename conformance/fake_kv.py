"""The fake KV memory the runner keeps beside the spec (docs/CONFORMANCE.md): a model
check that catches sharing bugs.

Each scheduled slot receives a :class:`KV` value for its position, in the executor's
order (swap-outs, swap-ins, copy-on-write, then the new K/V): the token, and what a real
model's K/V there depends on besides it: every token before it (``context``, a digest)
and the request's key domain (LoRA adapter, cache salt). The slots of rejected drafts are
poisoned; after each step every request must read back exactly its own values through
its block table, on the device and in the host swap pool. A wrong value names the bug by
what it is: never written (POS), a rejected draft's (KVLEN), another request's in a
shared or cached block (PREFIX), in a private one (BLOCK), or the right token computed in
another key domain or behind another prefix (PREFIX, rule ``key-domains``: a cache key
that leaves out an input of the K/V).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from refserve.conformance.adapter import StepReport
from refserve.spec.arith import slot_of
from refserve.spec.prefix import KEY_DOMAINS
from refserve.spec.snapshot import EngineSnapshot, TableSnapshot
from refserve.spec.violation import Invariant, Violation, violation


class KV(NamedTuple):
    """What one slot holds: a token's K/V and everything it was computed from."""

    token: int
    context: int
    """A digest of every token before this one (:func:`contexts`)."""
    domain: str
    """The request's key domain (``RequestPlan.domain``; ``""``: the default one)."""


#: A rejected draft's slot in the fake KV memory: never a :class:`KV`.
POISONED = -1

#: What a slot of the fake memory holds: a :class:`KV`, or :data:`POISONED`.
Slot = KV | int

#: The tokens each request knows (prompt, then outputs), by request id.
Tokens = Mapping[str, Sequence[int]]


def contexts(tokens: Sequence[int], upto: int) -> list[int]:
    """``out[p]``: a digest of ``tokens[:p]`` for ``p < upto`` (Python's hash of a tuple
    of ints is the same in every process, unlike a string's)."""
    out = [0] * upto
    for p in range(1, upto):
        out[p] = hash((out[p - 1], tokens[p - 1]))
    return out


def expected_values(tokens: Sequence[int], domain: str, upto: int) -> list[KV]:
    """The :class:`KV` a correct engine holds at positions ``[0, upto)``."""
    upto = min(upto, len(tokens))
    return [KV(t, c, domain) for t, c in zip(tokens[:upto], contexts(tokens, upto), strict=True)]


def token_of(value: Slot | None) -> int | None:
    """The token a slot holds (``None``: never written; :data:`POISONED` as is)."""
    return value.token if isinstance(value, KV) else value


@dataclass
class FakeKV:
    """Slot -> :class:`KV`, on the device and in the host swap pool."""

    domains: Mapping[str, str] = field(default_factory=dict)
    """Each request's key domain (absent: the default one)."""
    device: dict[int, Slot] = field(default_factory=dict)
    host: dict[int, Slot] = field(default_factory=dict)

    def tokens_on(self, where: str) -> tuple[tuple[int, int], ...]:
        """Slot -> token of the device (``"device"``) or host memory, for the migration
        rules, which compare tokens (poisoned slots keep their marker)."""
        memory = self.device if where == "device" else self.host
        return tuple(sorted((s, v.token if isinstance(v, KV) else v) for s, v in memory.items()))

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
            domain = self.domains.get(s.request_id, "")
            ctx = contexts(toks, min(len(toks), max(s.positions, default=-1) + 1))
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
                self.device[slot] = KV(toks[pos], ctx[pos], domain)
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
        want = expected_values(toks, self.domains.get(t.request_id, ""), t.num_stored)
        for p, w in enumerate(want):
            idx = p // bs
            if idx >= len(t.block_table):
                return None  # POS reports the short table
            b = t.block_table[idx]
            value = self.device.get(slot_of(b, p, bs))
            if value == w:
                continue
            got = token_of(value)
            who = f"request {t.request_id}"
            if isinstance(value, KV) and value.token == w.token:
                return _crossed(who, p, b, w, value)
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
            return violation(inv, who, f"KV read back at position {p}: {why}", w.token, got)
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
            domain = self.domains.get(t.request_id, "")
            upto = min(t.num_stored, len(t.block_table) * bs)
            for p, w in enumerate(expected_values(toks, domain, upto)):
                got = self.host.get(slot_of(t.block_table[p // bs], p, bs))
                if got != w:
                    out.append(
                        violation(
                            Invariant.BLOCK,
                            f"request {t.request_id}",
                            f"host KV read back at position {p}: swapped-out K/V lost",
                            w.token,
                            token_of(got),
                        )
                    )
                    break
        return out


def _crossed(who: str, p: int, b: int, want: KV, got: KV) -> Violation:
    """The right token, computed from other inputs: a cache key that left one out."""
    if got.domain != want.domain:
        why = f"block {b} holds this token's K/V computed in another key domain"
        expected, seen = _domain(want.domain), _domain(got.domain)
    else:
        why = f"block {b} holds this token's K/V computed behind another prefix"
        expected, seen = "behind this request's tokens", "behind other tokens"
    return violation(
        Invariant.PREFIX,
        who,
        f"KV read back at position {p}: {why}",
        f"token {want.token} {expected}",
        f"token {got.token} {seen}",
        rule=KEY_DOMAINS,
    )


def _domain(domain: str) -> str:
    return f"in {domain}" if domain else "in the default domain"


def _copy_block(
    src_kv: dict[int, Slot], src: int, dst_kv: dict[int, Slot], dst: int, bs: int
) -> None:
    """Block ``src``'s slots onto block ``dst``'s (an unwritten slot stays unwritten)."""
    for off in range(bs):
        v = src_kv.get(src * bs + off)
        if v is None:
            dst_kv.pop(dst * bs + off, None)
        else:
            dst_kv[dst * bs + off] = v
