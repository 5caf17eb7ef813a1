"""PREFIX: cached blocks are reused only under an identical chain prefix, and never written.

Why it matters: example 3 of docs/ARCHITECTURE.md reuses 6K tokens of a 10K prompt (its 375
blocks only gain references), and a shared block needs copy-on-write (or another form of
isolation) once one of its holders writes, or they overwrite each other. A reused block
whose earlier tokens differ gives attention the wrong context with no error anywhere. Known
bugs elsewhere (same document): a hash entry left pointing at a block after it was reused
for other tokens; a fully cached prompt that schedules zero tokens (the last prompt token
must be recomputed for a logit).
"""

from __future__ import annotations

from collections import defaultdict

from refserve.spec.arith import full_blocks, max_cacheable_tokens
from refserve.spec.hashing import block_key, chain_keys
from refserve.spec.snapshot import (
    NULL_BLOCK,
    PoolSnapshot,
    RequestStatus,
    StepSnapshot,
    TableSnapshot,
)
from refserve.spec.violation import Invariant, Violation, violation

X = Invariant.PREFIX
#: The rule that K/V computed in one key domain (LoRA adapter, cache salt) never serves
#: another, and equal tokens behind another prefix never share a block.
KEY_DOMAINS = "key-domains"


def check_prefix(pool: PoolSnapshot) -> list[Violation]:
    out: list[Violation] = []
    bs = pool.block_size
    holders: dict[int, list[tuple[TableSnapshot, int]]] = defaultdict(list)
    for t in pool.tables:
        for i, b in enumerate(t.block_table):
            if b != NULL_BLOCK or not pool.null_entries:  # a null place holds no block
                holders[b].append((t, i))
    seen_keys: set[bytes] = set()
    seen_blocks: set[int] = set()
    for e in pool.cache_entries:
        who = f"block {e.block_id}"
        if e.key in seen_keys:
            out.append(violation(X, who, "two cache entries share one key"))
        seen_keys.add(e.key)
        if e.block_id in seen_blocks:
            out.append(violation(X, who, "block indexed under two keys"))
        seen_blocks.add(e.block_id)
        if len(e.token_ids) != bs:
            out.append(violation(X, who, "only full blocks may be cached", bs, len(e.token_ids)))
        if block_key(e.parent_key, e.token_ids) != e.key:
            out.append(violation(X, who, "cache key is not the hash of parent key and token ids"))
        for t, i in holders.get(e.block_id, []):
            owner = f"block {e.block_id} (request {t.request_id}, logical {i})"
            if t.num_stored < (i + 1) * bs:
                out.append(
                    violation(
                        X,
                        owner,
                        "cached block is not full in a table holding it",
                        (i + 1) * bs,
                        t.num_stored,
                    )
                )
                continue
            live = t.token_ids[i * bs : (i + 1) * bs]
            if live != e.token_ids:
                out.append(
                    violation(
                        X,
                        owner,
                        "cache entry points at a block now holding other tokens",
                        e.token_ids,
                        live,
                    )
                )
                continue
            if chain_keys(t.root_key, t.token_ids, bs, i + 1)[-1] != e.key:
                out.append(
                    violation(X, owner, "block reused under a different chain prefix or namespace")
                )
    for b, hs in holders.items():
        if len(hs) < 2:
            continue
        t0, i0 = hs[0]
        for t, i in hs[1:]:
            who = f"block {b} (requests {t0.request_id}, {t.request_id})"
            if i != i0:
                out.append(violation(X, who, "shared block at different logical indices", i0, i))
                continue
            if t.root_key != t0.root_key:
                out.append(violation(X, who, "block shared across namespaces", rule=KEY_DOMAINS))
                continue
            end = min(t.num_stored, t0.num_stored, (i + 1) * bs)
            if t.token_ids[:end] != t0.token_ids[:end]:
                out.append(
                    violation(
                        X,
                        who,
                        "block shared by requests whose prefixes differ",
                        t0.token_ids[:end],
                        t.token_ids[:end],
                    )
                )
    return out


def check_prefix_step(step: StepSnapshot, same_step_hits: bool = False) -> list[Violation]:
    """Writes go to private blocks; cache hits are whole blocks and spare the last token.

    ``same_step_hits`` (a declared convention, docs/CONFORMANCE.md): the engine lets a
    request take as a cache hit a block that another request fills in the same step,
    because its executor writes each layer's K/V for the whole batch before that layer's
    attention reads any of it. The write into such a block is then allowed when every
    other holder took the block in this very step; a holder from an earlier step is
    still reading K/V that this write changes, which stays a violation.
    """
    out: list[Violation] = []
    bs = step.after.pool.block_size
    # A cached block may be written only once nobody reads it any more: the step evicted
    # it (it was free, or its holders let go of it in this very step) and handed it out.
    # It may then even be re-indexed under its old key if the new owner writes the same
    # tokens. A write into a cached block that the writer itself held (rewriting computed
    # KV) or that a holder still reads after the step is the violation.
    holders: dict[int, list[str]] = defaultdict(list)
    for t in step.before.pool.tables:
        for b in t.block_table:
            holders[b].append(t.request_id)
    cached_before = {e.block_id for e in step.before.pool.cache_entries}
    holders_after: dict[int, set[str]] = defaultdict(set)
    for t in step.after.pool.tables:
        for b in t.block_table:
            holders_after[b].add(t.request_id)
    for s in step.scheduled:
        who = f"request {s.request_id}"
        for slot in s.slot_mapping:
            b = slot // bs
            shared = 0 <= b < len(step.after.pool.ref_cnt) and step.after.pool.ref_cnt[b] > 1
            if shared and same_step_hits:
                others = holders_after[b] - {s.request_id}
                shared = bool(others & set(holders.get(b, ())))
            if shared:
                out.append(
                    violation(
                        X,
                        who,
                        f"writes into block {b} shared by several requests",
                        "ref_cnt 1 (copy-on-write)",
                        step.after.pool.ref_cnt[b],
                    )
                )
                break
            # A holder that let go of the block in this step (a window group's table
            # whose window moved past it) no longer reads it.
            readers = [h for h in holders.get(b, ()) if h == s.request_id or h in holders_after[b]]
            if b in cached_before and readers:
                out.append(
                    violation(
                        X,
                        who,
                        f"writes into block {b} that was already cached",
                        "an evicted block",
                        f"still held by {', '.join(sorted(readers))}",
                    )
                )
                break
        before = step.before.request(s.request_id)
        if before is not None and s.num_new_cached_tokens > max_cacheable_tokens(
            max(before.num_tokens, 1), bs
        ):
            # Judged against the tokens known when the hit was taken: after the step the
            # request has sampled one more, which would hide a full-prompt hit.
            out.append(
                violation(
                    X,
                    who,
                    "cache hit covers the last known token (no logit)",
                    f"<= {max_cacheable_tokens(max(before.num_tokens, 1), bs)}",
                    s.num_new_cached_tokens,
                )
            )
        if s.num_new_cached_tokens % bs != 0:
            out.append(
                violation(
                    X,
                    who,
                    "cache hit is not a whole number of blocks",
                    f"multiple of {bs}",
                    s.num_new_cached_tokens,
                )
            )
    for r in step.after.requests:
        if r.num_cached_tokens > 0 and r.num_cached_tokens > max_cacheable_tokens(
            max(r.num_tokens, 1), bs
        ):
            out.append(
                violation(
                    X,
                    f"request {r.request_id}",
                    "cache hit covers the last known token (no logit)",
                    f"<= {max_cacheable_tokens(max(r.num_tokens, 1), bs)}",
                    r.num_cached_tokens,
                )
            )
    return out


#: The named rule of PREFIX for declared same-step hits kept.
DECLARED_SAME_STEP_HITS = "declared-same-step-hits"

_ADMITTABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def check_same_step_hits(step: StepSnapshot) -> list[Violation]:
    """PREFIX, rule ``declared-same-step-hits``: an engine that declares same-step hits
    takes them (where the declaration says it hits, it does), once, in one block.

    The declaration (docs/CONFORMANCE.md) says a full block is indexed as soon as a
    request is scheduled to fill it, so a request admitted later in the same step takes
    it as a hit. :func:`check_prefix_step` lets the writer fill such a shared block; this
    is the other direction:

    * a block is written by one request in a step: a request that shares it took it as
      a hit and does not compute it again (the hit is taken once);
    * two requests admitted in the step (never-run or recomputing, no block before it,
      no K/V loaded from another store) whose tables hold the same full block of tokens
      behind the same prefix and namespace, in a block that a hit of either may cover
      (whole blocks, the last known token left to compute), hold it in one block: the
      one scheduled second hits what the first is filling, whichever that was, so two
      blocks mean the prefix was computed twice.

    Judged on the tables after the step, so a request that finished in the step (its
    table gone) is not judged; the order in which the engine planned the two is not
    needed. Only for an engine that declares the convention, with prefix caching on.
    """
    return [*_written_twice(step), *_computed_twice(step)]


def _written_twice(step: StepSnapshot) -> list[Violation]:
    """A block written by several requests in one step: a shared block recomputed."""
    bs = step.after.pool.block_size
    writers: dict[int, list[str]] = defaultdict(list)
    for s in step.scheduled:
        for b in dict.fromkeys(slot // bs for slot in s.slot_mapping):
            writers[b].append(s.request_id)
    return [
        violation(
            X,
            f"block {b}",
            f"written by {len(rids)} requests in one step ({', '.join(rids)}): with same-step "
            "hits declared the block is computed once, the others take it as a hit",
            "1 writer",
            len(rids),
            rule=DECLARED_SAME_STEP_HITS,
        )
        for b, rids in writers.items()
        if len(rids) > 1
    ]


def _admitted_hittable(step: StepSnapshot) -> list[tuple[TableSnapshot, int]]:
    """The tables of the requests the step admitted with no K/V (never run, or
    recomputing after a preemption; none loaded from another store), each with how many
    of its leading blocks a hit may cover and it holds full after the step."""
    bs = step.after.pool.block_size
    out: list[tuple[TableSnapshot, int]] = []
    for s in step.scheduled:
        before = step.before.request(s.request_id)
        table = step.after.pool.table(s.request_id)
        if (
            before is None
            or table is None
            or before.status not in _ADMITTABLE
            or before.num_computed_tokens != 0
            or s.num_new_loaded_tokens
            or step.before.pool.table(s.request_id) is not None
        ):
            continue
        hittable = full_blocks(max_cacheable_tokens(max(before.num_tokens, 1), bs), bs)
        full = full_blocks(table.num_stored, bs)
        out.append((table, min(hittable, full, len(table.block_table))))
    return out


def _computed_twice(step: StepSnapshot) -> list[Violation]:
    """Two requests admitted in the step holding one cacheable prefix block in two."""
    bs = step.after.pool.block_size
    admitted = _admitted_hittable(step)
    out: list[Violation] = []
    for n, (t1, h1) in enumerate(admitted):
        for t2, h2 in admitted[n + 1 :]:
            if t1.root_key != t2.root_key:
                continue
            for i in range(min(h1, h2)):
                end = (i + 1) * bs
                if t1.token_ids[:end] != t2.token_ids[:end]:
                    break
                if t1.block_table[i] != t2.block_table[i]:
                    out.append(
                        violation(
                            X,
                            f"requests {t1.request_id}, {t2.request_id}",
                            f"both admitted in one step, they hold logical block {i} of one "
                            "prefix in two blocks: with same-step hits declared the one "
                            "planned second takes the other's block as a hit",
                            f"one block ({t1.block_table[i]})",
                            f"blocks {t1.block_table[i]} and {t2.block_table[i]}",
                            rule=DECLARED_SAME_STEP_HITS,
                        )
                    )
                    break
    return out
