"""The scenario library: the worked examples and every "known bug elsewhere".

Both are described in docs/ARCHITECTURE.md ("Worked examples", "Known bugs elsewhere");
scenario names keep the examples' historical ``seedNNN`` prefix (``seed001`` is example 1).

Each :class:`~refserve.conformance.workload.Scenario` is a small fixed workload; ``targets`` names
the invariants it is meant to provoke, but every invariant is checked on every step of
every scenario. Scenarios whose workload needs a feature an engine lacks (chunked
prefill, abort, priorities, rollback, prefix caching off) are reported ``not_supported``.
The Hypothesis-generated workloads live in :mod:`refserve.conformance.generate`.
"""

from __future__ import annotations

from refserve.conformance.adapter import EngineConfig
from refserve.conformance.workload import (
    EOS,
    MigrationPlan,
    RequestPlan,
    Scenario,
    Workload,
    next_token,
    prompt,
)


def _cfg(
    bs: int, blocks: int, budget: int, seqs: int, *, caching: bool = True, spec: int = 0
) -> EngineConfig:
    return EngineConfig(
        block_size=bs,
        num_blocks=blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        enable_prefix_caching=caching,
        eos_token_id=EOS,
        num_speculative_tokens=spec,
    )


def R(
    rid: str,
    toks: tuple[int, ...],
    max_tokens: int,
    at: int = 0,
    *,
    prio: int = 0,
    stop_at: int | None = None,
    abort_at: int | None = None,
    salt: str = "",
    lora: str = "",
) -> RequestPlan:
    return RequestPlan(rid, toks, max_tokens, at, prio, stop_at, abort_at, salt, lora)


def _seeds() -> list[Scenario]:
    prefix24 = prompt(90, 24)
    return [
        Scenario(
            "seed001-round-by-round",
            "Example 1: budget 8, 3 seqs, block 4; A decoding ends after round 2, B prompt 12, "
            "C prompt 3 arrives before round 2. Expected r1 A:1 B:7; r2 A:1 B:5 C:2; "
            "r3 B:1 C:1; r4 B:1 C:1.",
            Workload(
                _cfg(4, 32, 8, 3),
                (R("A", prompt(1, 1), 3), R("B", prompt(2, 12), 3, 1), R("C", prompt(3, 3), 2, 2)),
            ),
            ("TOKEN", "POS", "KVLEN"),
            golden=(
                (("A", 1), ("B", 7)),
                (("A", 1), ("B", 5), ("C", 2)),
                (("B", 1), ("C", 1)),
                (("B", 1), ("C", 1)),
            ),
            golden_from_step=1,
        ),
        Scenario(
            "seed002-budget-14",
            "Example 2b: 2 decodes + a 12-token prompt, budget 14: the prompt fits in one step.",
            Workload(
                _cfg(4, 64, 14, 8),
                (R("D1", prompt(4, 1), 6), R("D2", prompt(5, 1), 6), R("X", prompt(6, 12), 2, 1)),
            ),
            ("TOKEN",),
            golden=((("D1", 1), ("D2", 1), ("X", 12)),),
            golden_from_step=1,
        ),
        Scenario(
            "seed002-budget-6",
            "Example 2b: 2 decodes + a 12-token prompt, budget 6: the prompt takes 3 chunks of 4.",
            Workload(
                _cfg(4, 64, 6, 8),
                (R("D1", prompt(4, 1), 6), R("D2", prompt(5, 1), 6), R("X", prompt(6, 12), 2, 1)),
            ),
            ("TOKEN", "POS"),
            golden=(
                (("D1", 1), ("D2", 1), ("X", 4)),
                (("D1", 1), ("D2", 1), ("X", 4)),
                (("D1", 1), ("D2", 1), ("X", 4)),
            ),
            golden_from_step=1,
        ),
        Scenario(
            "seed002-p7-d5",
            "Example 2c: budget 12, 5 decodes, A needs 10 prefill, B waits: A gets 7, B 0.",
            Workload(
                _cfg(4, 64, 12, 16),
                (
                    *(R(f"D{i}", prompt(10 + i, 1), 4) for i in range(5)),
                    R("A", prompt(20, 10), 2, 1),
                    R("B", prompt(21, 4), 2, 1),
                ),
            ),
            ("TOKEN",),
            golden=(((*((f"D{i}", 1) for i in range(5)), ("A", 7))),),
            golden_from_step=1,
        ),
        Scenario(
            "seed002-decode-starves-prefill",
            "Example 2d: budget 8, always 8 decodes: decode-first defers the waiting prompt; it "
            "must still run within the starvation bound.",
            Workload(
                _cfg(4, 256, 8, 16),
                (
                    *(R(f"D{i}", prompt(30 + i, 1), 24) for i in range(8)),
                    R("X", prompt(40, 6), 2, 1),
                ),
            ),
            ("PROGRESS",),
        ),
        Scenario(
            "seed002-admission-headroom",
            "Example 2e (scaled): a pool 90% used by a growing request, a new prompt needs 10% "
            "of it; admission must not promise KV it cannot deliver without preemption.",
            Workload(
                _cfg(4, 10, 64, 4),
                (R("A", prompt(50, 33), 6), R("B", prompt(51, 5), 4, 1)),
            ),
            ("CAP", "PROGRESS"),
        ),
        Scenario(
            "seed003-prefix-reuse",
            "Example 3 (scaled): 3 decodes plus a 40-token prompt whose first 24 tokens are "
            "cached by an earlier request; the shared blocks only gain references.",
            Workload(
                _cfg(4, 40, 64, 8),
                (
                    R("W", (*prefix24, 7), 1),
                    *(R(f"D{i}", prompt(60 + i, 1), 8) for i in range(3)),
                    R("Q", (*prefix24, *prompt(61, 16)), 2, 2),
                ),
            ),
            ("PREFIX", "BLOCK"),
        ),
    ]


def _known_bugs() -> list[Scenario]:
    p8 = prompt(100, 8)
    p9 = prompt(101, 9)
    shared = prompt(102, 12)
    return [
        Scenario(
            "bug-double-free-shared-blocks",
            "Freeing a list that holds the same block twice: two requests share prompt blocks "
            "and finish in the same step, one after a preemption.",
            Workload(
                _cfg(2, 9, 16, 4),
                (R("A", shared[:6], 4), R("B", shared[:6], 4), R("C", prompt(103, 5), 4)),
            ),
            ("BLOCK",),
        ),
        Scenario(
            "bug-stale-hash-entry",
            "A prefix-cache entry left pointing at a block after it was reused for other "
            "tokens: A's blocks are freed, B reuses them, C repeats A's prompt.",
            Workload(
                _cfg(4, 3, 16, 2),
                (R("A", p9, 1), R("B", prompt(104, 9), 2, 1), R("C", p9, 2, 3)),
            ),
            ("PREFIX",),
        ),
        Scenario(
            "bug-fully-cached-prompt-concurrent",
            "A fully cached, block-aligned prompt must still schedule >= 1 token (the last "
            "one, for a logit): B repeats A's 8-token prompt while A still runs.",
            Workload(_cfg(4, 12, 32, 4), (R("A", p8, 6), R("B", p8, 3, 1))),
            ("PREFIX", "TOKEN", "PROGRESS"),
        ),
        Scenario(
            "bug-block-aligned-prompt-recompute",
            "A block-aligned prompt whose blocks are all cached by a finished request must "
            "still recompute its last block (the hit stops one block short).",
            Workload(_cfg(4, 12, 32, 4), (R("A", p8, 1), R("B", p8, 3, 2))),
            ("PREFIX", "KVLEN"),
        ),
        Scenario(
            "bug-same-step-new-shared-prefix",
            "Two requests sharing a new (never cached) prefix are admitted in the same step.",
            Workload(
                _cfg(4, 16, 32, 4),
                (R("A", (*shared, 5), 3), R("B", (*shared, 6), 3), R("C", (*shared, 5), 2, 1)),
            ),
            ("PREFIX", "BLOCK"),
        ),
        Scenario(
            "bug-abort-waiting",
            "Abort a request still waiting for blocks, then the leak check.",
            Workload(
                _cfg(4, 4, 32, 4),
                (R("A", prompt(110, 12), 4), R("B", prompt(111, 8), 4, abort_at=1)),
            ),
            ("PROGRESS", "BLOCK"),
        ),
        Scenario(
            "bug-abort-mid-prefill",
            "Abort a request between two chunks of its prompt, then the leak check.",
            Workload(_cfg(4, 16, 4, 4), (R("A", prompt(112, 14), 4, abort_at=2),)),
            ("PROGRESS", "BLOCK"),
        ),
        Scenario(
            "bug-abort-decoding",
            "Abort a decoding request that shares cached blocks, then the leak check.",
            Workload(
                _cfg(4, 16, 32, 4),
                (R("A", p9, 8, abort_at=3), R("B", p9, 4, 1)),
            ),
            ("PROGRESS", "BLOCK", "PREFIX"),
        ),
        Scenario(
            "bug-abort-preempted",
            "Abort a request right after it was preempted, then the leak check.",
            Workload(
                _cfg(2, 6, 16, 4),
                (R("A", prompt(113, 3), 8), R("B", prompt(114, 3), 8, abort_at=4)),
            ),
            ("PROGRESS", "BLOCK", "TOKEN"),
        ),
        Scenario(
            "bug-preemption-storm",
            "num_computed_tokens must never exceed num_tokens under a preemption storm: "
            "a tiny pool, many growing requests.",
            Workload(
                _cfg(2, 6, 16, 6),
                tuple(R(f"S{i}", prompt(120 + i, 3), 6, i % 3) for i in range(6)),
            ),
            ("TOKEN", "KVLEN", "PROGRESS"),
        ),
        Scenario(
            "bug-preempted-loses-place-priority",
            "A preempted request must not lose its place under priorities: a low-priority "
            "runner is preempted for a high-priority arrival and must still finish in bound.",
            Workload(
                _cfg(2, 6, 16, 4),
                (
                    R("LOW", prompt(130, 3), 6, prio=1),
                    R("HI", prompt(131, 3), 6, 1, prio=0),
                    R("LATE", prompt(132, 3), 4, 2, prio=1),
                ),
            ),
            ("PROGRESS",),
        ),
        Scenario(
            "bug-head-of-line-kv-heavy",
            "Head-of-line blocking behind one KV-heavy request: small requests wait behind "
            "a request that takes most of the pool; all must finish within the bound.",
            Workload(
                _cfg(4, 8, 32, 4),
                (
                    R("HEAVY", prompt(140, 25), 4),
                    *(R(f"s{i}", prompt(141 + i, 3), 2, 1) for i in range(3)),
                ),
            ),
            ("PROGRESS", "CAP"),
        ),
        Scenario(
            "order-head-of-line-blocking",
            "A head that does not fit holds back a small request behind it (strict orders): "
            "A takes 5 of 8 blocks; X (16 tokens, 4 blocks) and then Y (3 tokens, 1 block) "
            "arrive together. A strict engine admits neither before A finishes; a lax one "
            "may admit Y (X never fits in what Y took).",
            Workload(
                _cfg(4, 8, 32, 4),
                (
                    R("A", prompt(145, 20), 4),
                    R("X", prompt(146, 16), 2, 1),
                    R("Y", prompt(147, 3), 2, 1),
                ),
            ),
            ("ORDER", "PROGRESS"),
        ),
        Scenario(
            "order-priority-head-of-line-blocking",
            "The same under priorities: X (priority 0, does not fit) arrives after Y "
            "(priority 1, fits); a strict priority engine admits Y only after X.",
            Workload(
                _cfg(4, 8, 32, 4),
                (
                    R("A", prompt(148, 20), 4, prio=1),
                    R("Y", prompt(149, 3), 2, 1, prio=1),
                    R("X", prompt(150, 16), 2, 1, prio=0),
                ),
            ),
            ("ORDER", "PROGRESS"),
        ),
        Scenario(
            "bug-first-chunk-admission-thrash",
            "Admission that checks only the first chunk then thrashes (admit, fill, preempt, "
            "repeat): long prompts in small chunks in a pool that holds only one of them.",
            Workload(
                _cfg(4, 6, 4, 4),
                tuple(R(f"L{i}", prompt(150 + i, 16), 3) for i in range(3)),
            ),
            ("PROGRESS", "CAP"),
        ),
        Scenario(
            "bug-lone-request-cannot-grow",
            "A single running request that cannot grow and has no victim must neither crash "
            "nor spin: prompt 6 in a 2-block pool of 4, max_tokens 8.",
            Workload(_cfg(4, 2, 16, 2), (R("A", prompt(160, 6), 8),)),
            ("PROGRESS",),
        ),
        Scenario(
            "bug-free-list-order",
            "Free-list reuse order must not change silently: blocks freed by finished "
            "requests are handed out in the order the snapshot's free queue states.",
            Workload(
                _cfg(2, 10, 16, 4),
                (
                    R("A", prompt(170, 3), 1),
                    R("B", prompt(171, 5), 2),
                    R("C", prompt(172, 3), 4),
                    R("D", prompt(173, 7), 2, 3),
                    R("E", prompt(174, 2), 2, 4),
                ),
            ),
            ("BLOCK",),
        ),
        Scenario(
            "atomic-rejected-empty-prompt",
            "A request with an empty prompt is rejected (or served) without changing state.",
            Workload(_cfg(4, 8, 16, 4), (R("A", prompt(180, 3), 2), R("BAD", (), 2))),
            ("ATOMIC",),
        ),
        Scenario(
            "atomic-oversized-prompt",
            "A prompt larger than the whole pool: rejected at submission, or finished, but "
            "never a crash or a spin.",
            Workload(_cfg(4, 3, 32, 4), (R("A", prompt(181, 3), 2), R("HUGE", prompt(182, 20), 2))),
            ("ATOMIC", "PROGRESS"),
        ),
        Scenario(
            "atomic-executor-fault",
            "The model fails mid-run (schedule then rollback) at several steps, including "
            "one with preemption and prefix hits; state must be exactly as before.",
            Workload(
                _cfg(2, 7, 16, 4),
                (
                    R("A", p9, 4),
                    R("B", p9, 4, 1),
                    R("C", prompt(183, 5), 4, 1),
                ),
                rollback_at=(0, 1, 2, 4),
            ),
            ("ATOMIC",),
        ),
        Scenario(
            "stop-token-forced",
            "The suite samples eos early for some requests: they finish with reason stop, "
            "free their blocks and the others continue.",
            Workload(
                _cfg(4, 12, 16, 4),
                (
                    R("A", prompt(190, 5), 8, stop_at=1),
                    R("B", prompt(191, 5), 8, stop_at=3),
                    R("C", prompt(192, 5), 3),
                ),
            ),
            ("KVLEN", "PROGRESS"),
        ),
        Scenario(
            "speculation-verify-and-roll-back",
            "Speculative decoding (docs/SPECULATIVE.md): the suite proposes up to 3 drafts "
            "per decode and accepts none, some or all of them by turns; the KV length rolls "
            "back by the rejected ones, whose slots are poisoned in the fake memory; eos "
            "lands among the drafts for one request.",
            Workload(
                _cfg(4, 32, 16, 4, spec=3),
                (
                    R("A", prompt(200, 5), 12),
                    R("B", prompt(201, 3), 9, 1, stop_at=5),
                    R("C", prompt(202, 6), 10, 2),
                ),
            ),
            ("KVLEN", "TOKEN", "POS"),
        ),
        Scenario(
            "speculation-under-pressure",
            "Drafts of 4 in a small pool with a shared prefix, chunked prompts and faults: "
            "the lookahead blocks must never cost another decode its place, preemption and "
            "rollback must find the books exact, and no cache entry may cover a draft.",
            Workload(
                _cfg(2, 12, 8, 4, spec=4),
                (
                    R("A", p9, 10),
                    R("B", p9, 8, 1),
                    R("C", prompt(203, 5), 9, 2),
                ),
                rollback_at=(3, 6),
            ),
            ("CAP", "PREFIX", "ATOMIC"),
        ),
        Scenario(
            "no-prefix-caching",
            "The same shared-prefix workload with prefix caching switched off: no sharing.",
            Workload(
                _cfg(4, 12, 16, 4, caching=False),
                (R("A", p9, 3), R("B", p9, 3, 1)),
            ),
            ("PREFIX", "BLOCK"),
        ),
    ]


def M(
    at: int, rid: str, to: int = 1, *, kv: bool = True, fault: str | None = None
) -> MigrationPlan:
    return MigrationPlan(at, rid, to, kv, fault)


def _migrations() -> list[Scenario]:
    """Feature ``migration``: requests move between instances of the engine (several
    adapters from one factory) at step boundaries; docs/CONFORMANCE.md, "Migration"."""
    p8 = prompt(210, 8)
    return [
        Scenario(
            "migration-decode-transfer",
            "Two decoding requests move with their K/V to a peer with another block size and "
            "pool, and back: the destination writes through its own tables, takes its own "
            "prefix hit on the way back, and every request reads back its tokens.",
            Workload(
                _cfg(4, 16, 8, 4),
                (R("A", prompt(211, 9), 6), R("B", prompt(212, 5), 6, 1)),
                peers=(_cfg(2, 24, 6, 4),),
                migrations=(M(2, "A"), M(3, "B"), M(5, "A", 0), M(6, "B", 0)),
            ),
            ("KVLEN", "POS", "BLOCK"),
        ),
        Scenario(
            "migration-mid-prefill",
            "A long prompt computed in small chunks moves between them, there and back, with the "
            "K/V computed so far; a second request decodes beside it on each side.",
            Workload(
                _cfg(4, 16, 4, 4),
                (R("L", prompt(213, 14), 3), R("D", prompt(214, 2), 8)),
                peers=(_cfg(2, 20, 4, 4),),
                migrations=(M(1, "L"), M(2, "L", 0), M(3, "L"), M(2, "D")),
            ),
            ("POS", "TOKEN"),
        ),
        Scenario(
            "migration-recompute",
            "Moves without K/V: a decoding request, a waiting one and one mid-prefill; the "
            "destination recomputes each (its outputs become prompt-like context) and they "
            "finish with the same tokens.",
            Workload(
                _cfg(4, 12, 4, 2),
                (R("A", prompt(215, 6), 5), R("W", prompt(216, 5), 3), R("P", prompt(217, 10), 3)),
                peers=(_cfg(4, 12, 6, 4),),
                migrations=(M(0, "W", kv=False), M(2, "A", kv=False), M(3, "P", kv=False)),
            ),
            ("TOKEN", "KVLEN"),
        ),
        Scenario(
            "migration-destination-hit",
            "W is moved while waiting and computes a shared 8-token prefix on the peer; Q, "
            "with the same prefix, is prefilled at home and moved with its K/V: the peer "
            "serves the prefix from its own cache and only the rest travels.",
            Workload(
                _cfg(4, 16, 16, 4),
                (R("W", (*p8, 5), 4), R("Q", (*p8, 6, 7, 8), 4, 1)),
                peers=(_cfg(4, 16, 16, 4),),
                migrations=(M(0, "W"), M(3, "Q")),
            ),
            ("PREFIX", "BLOCK"),
        ),
        Scenario(
            "migration-link-faults",
            "The link fails before the destination's ack for two requests mid-prefill: "
            "the destination must be exactly as before the stage and each request run on "
            "at home; a client abort in transit finishes a decoding request once; then a "
            "move succeeds.",
            Workload(
                _cfg(4, 16, 4, 4),
                (R("X", prompt(220, 3), 8), R("A", prompt(218, 6), 7), R("L", prompt(219, 12), 3)),
                peers=(_cfg(2, 20, 4, 4),),
                migrations=(
                    M(2, "A", fault="before_ack"),
                    M(4, "L", fault="before_ack"),
                    M(3, "X", fault="abort_in_transit"),
                    M(4, "A"),
                ),
            ),
            ("ATOMIC", "PROGRESS"),
        ),
        Scenario(
            "migration-refused",
            "The peer has room for one running request: the second move is refused, must "
            "leave the peer exactly as it was, and the request runs on at home.",
            Workload(
                _cfg(4, 16, 8, 4),
                (R("A", prompt(221, 5), 5), R("B", prompt(222, 5), 5)),
                peers=(_cfg(4, 16, 8, 1),),
                migrations=(M(2, "A"), M(3, "B")),
            ),
            ("ATOMIC",),
        ),
        Scenario(
            "migration-under-preemption",
            "A tiny home pool preempts (or swaps) its requests; they are moved wherever "
            "they stand, preempted included, to a roomy peer and some of them back.",
            Workload(
                _cfg(2, 6, 8, 4),
                tuple(R(f"S{i}", prompt(223 + i, 3), 8, i % 2) for i in range(3)),
                peers=(_cfg(2, 16, 8, 4),),
                migrations=(M(3, "S1"), M(4, "S2"), M(5, "S0"), M(7, "S1", 0)),
            ),
            ("BLOCK", "TOKEN", "PROGRESS"),
        ),
        Scenario(
            "migration-three-engines",
            "One request travels A -> B -> C -> A, by transfer and by recompute, across "
            "three block sizes, while others stay put.",
            Workload(
                _cfg(4, 16, 6, 4),
                (R("T", prompt(227, 7), 8), R("H", prompt(228, 4), 6)),
                peers=(_cfg(2, 20, 6, 4), _cfg(1, 40, 6, 4)),
                migrations=(M(2, "T", 1), M(4, "T", 2), M(6, "T", 0, kv=False), M(3, "H", 2)),
            ),
            ("POS", "KVLEN"),
        ),
        Scenario(
            "disaggregation-prefill-decode",
            "Prefill/decode disaggregation: every request is prefilled on A (a large "
            "budget) and moved to B with its K/V right after its first token; B decodes. "
            "Two share a prompt prefix, one is too long for a single prefill step.",
            Workload(
                _cfg(4, 24, 12, 4),
                (
                    R("A", (*p8, 9, 10), 4),
                    R("B", (*p8, 11), 3, 1),
                    R("C", prompt(229, 20), 3, 1),
                    R("D", prompt(230, 3), 5, 2),
                ),
                peers=(_cfg(2, 40, 4, 4),),
                disaggregated=True,
            ),
            ("KVLEN", "POS", "PREFIX"),
        ),
    ]


def _answer(toks: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The ``n`` tokens the suite's greedy model answers ``toks`` with (no eos)."""
    out: list[int] = []
    for _ in range(n):
        out.append(next_token((*toks, *out)))
    return tuple(out)


def _pressure() -> list[Scenario]:
    """Progress under KV pressure with K/V parked outside the device.

    An engine with a host tier (a KV connector that offloads) keeps a finished request's
    K/V there after the device evicts it, and a later request that shares the prefix
    loads it back: it holds blocks while the load is in flight and after it lands. A
    large request of higher priority then arrives; it can fit only once the others
    finish, so the engine must keep running them. An engine without a host tier runs
    the same requests with a recompute and meets the same queue."""
    shared = prompt(3, 8)
    turn = prompt(61, 6)
    return [
        Scenario(
            "pressure-parked-load-behind-large-head",
            "P's 8-token prompt is computed and evicted by E (45 tokens, nearly the pool); R "
            "(priority 0) decodes while L (priority 1) repeats P's prefix, loaded back by an "
            "engine with a host tier; H (priority 0, 44 tokens: 11 of the 12 blocks) "
            "arrives and waits ahead of L. Every request must finish.",
            Workload(
                _cfg(4, 12, 64, 4),
                (
                    R("P", shared, 1, 0, prio=1),
                    R("E", prompt(9, 45), 1, 1, prio=1),
                    R("R", prompt(5, 4), 5, 2, prio=0),
                    R("L", (*shared, *prompt(6, 2)), 4, 2, prio=1),
                    R("H", prompt(8, 44), 1, 3, prio=0),
                ),
            ),
            ("PROGRESS",),
        ),
        Scenario(
            "pressure-loads-back-at-once",
            "A0 (16 tokens) and B0 (24) are computed; E (56 tokens) evicts them from the "
            "device (an engine with a host tier keeps their K/V); R decodes. A (A0's prompt + "
            "28: 11 of the 16 blocks) and B (B0's + 6: 8 blocks) arrive together: each fits "
            "alone, not both. A load admitted beside another must leave what the first "
            "still needs. Every request must finish.",
            Workload(
                _cfg(4, 16, 64, 4),
                (
                    R("A0", prompt(21, 16), 1, 0),
                    R("B0", prompt(22, 24), 1, 0),
                    R("R", prompt(5, 4), 10, 0),
                    R("E", prompt(9, 56), 1, 1),
                    R("A", (*prompt(21, 16), *prompt(23, 28)), 2, 4),
                    R("B", (*prompt(22, 24), *prompt(24, 6)), 2, 4),
                ),
            ),
            ("PROGRESS",),
        ),
        Scenario(
            "pressure-deferred-lookup-ahead-of-load",
            "A shared prefix p (16 tokens) and a conversation q (24) are computed, then "
            "evicted by E (a host tier keeps them); R decodes. P (p + 2), H (p + 32: 12 of the "
            "16 blocks) and L (q + 2) arrive together: P loads p, H shares p and must wait "
            "for P's load, L loads q. H, holding nothing, fits only after L finishes. Every "
            "request must finish.",
            Workload(
                _cfg(4, 16, 64, 4),
                (
                    R("P0", prompt(41, 16), 1, 0),
                    R("Q0", prompt(42, 24), 1, 0),
                    R("R", prompt(5, 4), 6, 0),
                    R("E", prompt(9, 56), 1, 1),
                    R("P", (*prompt(41, 16), *prompt(43, 2)), 2, 4),
                    R("H", (*prompt(41, 16), *prompt(44, 32)), 2, 4),
                    R("L", (*prompt(42, 24), *prompt(45, 2)), 3, 4),
                ),
            ),
            ("PROGRESS",),
        ),
        Scenario(
            "pressure-victim-recomputes-without-cache",
            "Prefix caching off: A and B (7 tokens each) decode in a pool of 5 blocks of 4, "
            "which holds one of them at full length. The one preempted gives its K/V up "
            "when the other grows into its blocks, and recomputes from its first token; "
            "both must finish.",
            Workload(
                _cfg(4, 5, 16, 2, caching=False),
                (R("A", prompt(51, 7), 8), R("B", prompt(52, 7), 8)),
            ),
            ("PROGRESS", "KVLEN", "BLOCK", "PREFIX"),
        ),
        Scenario(
            "pressure-loads-land-with-drafts",
            "Speculative decoding, 3 drafts: A0 (16 tokens) and B0 (12) are computed and "
            "evicted by E (27 tokens, the whole pool of 7 blocks; a host tier keeps their "
            "K/V). A (A0's prompt) and B (B0's) arrive together: loaded back, they fill the "
            "pool, and A's first step after its load (its last prompt token and the drafts "
            "after it) needs one block more. A load admitted beside another must leave "
            "what the first needs for that step. Every request must finish.",
            Workload(
                _cfg(4, 7, 32, 4, spec=3),
                (
                    R("A0", prompt(51, 16), 1, 0),
                    R("B0", prompt(52, 12), 1, 0),
                    R("E", prompt(9, 27), 1, 1),
                    R("A", prompt(51, 16), 3, 4),
                    R("B", prompt(52, 12), 3, 4),
                ),
            ),
            ("PROGRESS",),
        ),
        Scenario(
            "pressure-chunked-prompt-again",
            "P's 14-token prompt is computed in two chunks (budget 8); E (31 tokens, the "
            "whole pool) evicts it from the device; Q repeats P's prompt. An engine with a "
            "host tier may load back only what it parked, and must compute the rest. Every "
            "request must finish.",
            Workload(
                _cfg(4, 8, 8, 4),
                (
                    R("P", prompt(51, 14), 1, 0),
                    R("E", prompt(9, 31), 1, 2),
                    R("Q", prompt(51, 14), 2, 6),
                ),
            ),
            ("PROGRESS",),
        ),
        Scenario(
            "pressure-next-turn",
            "A (6 tokens) answers with 2, ending on a block boundary; E (31 tokens) evicts it "
            "from the device; B is A's conversation, answer included, plus 2 new tokens. A "
            "never computed the K/V of its last output (nothing follows it), so no cache, on "
            "the device or off it, may serve that position to B. Every request must finish.",
            Workload(
                _cfg(4, 8, 16, 4),
                (
                    R("A", turn, 2, 0),
                    R("E", prompt(9, 31), 1, 2),
                    R("B", (*turn, *_answer(turn, 2), *prompt(62, 2)), 2, 5),
                ),
            ),
            ("PREFIX", "POS"),
        ),
        Scenario(
            "pressure-aborted-prompt-again",
            "X (16 tokens) computes a first chunk of 6 (budget 6) and is aborted; E (31 "
            "tokens) evicts it from the device; Y repeats X's prompt. X computed positions "
            "0-5 only, so no cache may serve Y a later position. Every request must finish.",
            Workload(
                _cfg(4, 8, 6, 4),
                (
                    R("X", prompt(71, 16), 2, 0, abort_at=1),
                    R("E", prompt(9, 31), 1, 2),
                    R("Y", prompt(71, 16), 2, 9),
                ),
            ),
            ("PREFIX", "POS"),
        ),
    ]


def _key_domains() -> list[Scenario]:
    """Requests whose K/V differs while their tokens do not (PREFIX, rule ``key-domains``).

    A real model's K/V at a position depends on every token before it and on the LoRA
    adapter; a cache salt asks that two tenants never share it. A cache key that leaves
    any of these out serves one request another's K/V, and the tokens alone cannot show
    it: the fake KV memory carries all three (conformance/fake_kv.py)."""
    p12 = prompt(110, 12)
    a, b, d, t = prompt(111, 4), prompt(112, 4), prompt(113, 4), prompt(114, 1)
    return [
        Scenario(
            "keys-cache-salt",
            "One 12-token prompt under no salt, salt t1 and salt t2, at once and after one "
            "another: only the two t1 requests may share blocks.",
            Workload(
                _cfg(4, 24, 32, 4),
                (
                    R("A", p12, 2),
                    R("B", p12, 2, 0, salt="t1"),
                    R("C", p12, 2, 4, salt="t2"),
                    R("D", p12, 2, 8, salt="t1"),
                ),
            ),
            ("PREFIX",),
        ),
        Scenario(
            "keys-lora",
            "One 12-token prompt on the base model, on adapter l1 and on adapter l2, at once "
            "and after one another: only the two l1 requests may share blocks.",
            Workload(
                _cfg(4, 24, 32, 4),
                (
                    R("A", p12, 2),
                    R("B", p12, 2, 0, lora="l1"),
                    R("C", p12, 2, 4, lora="l2"),
                    R("D", p12, 2, 8, lora="l1"),
                ),
            ),
            ("PREFIX",),
        ),
        Scenario(
            "keys-salt-named-like-adapter",
            "A LoRA adapter named x and a cache salt x on the same prompt: two different "
            "inputs that a key built from untagged strings confuses.",
            Workload(
                _cfg(4, 24, 32, 4),
                (R("A", p12, 2, lora="x"), R("B", p12, 2, 4, salt="x")),
            ),
            ("PREFIX",),
        ),
        Scenario(
            "keys-refill-behind-other-prefix",
            "Blocks freed and refilled with the same tokens behind another prefix: a+b, then "
            "b+a, then a+b and b+a again, one after another in a pool of three blocks. A "
            "request may reuse only K/V computed behind its own prefix (the last two decode "
            "once, so their tables are read back after the hit).",
            Workload(
                _cfg(4, 3, 16, 1),
                (
                    R("X", (*a, *b), 1),
                    R("Y", (*b, *a), 1, 3),
                    R("Z", (*a, *b), 2, 6),
                    R("V", (*b, *a), 2, 9),
                ),
            ),
            ("PREFIX",),
        ),
        Scenario(
            "keys-refill-reversed",
            "Freed blocks refilled last block first, with the same tokens behind another "
            "prefix: a+b+t, then d+b+a, then a+b+t again in a pool of three blocks. An engine "
            "that frees a table from its end and hands out from the head of its free list "
            "puts b (behind d) where b behind a was, and a (behind d+b) where a was; Z may "
            "reuse neither.",
            Workload(
                _cfg(4, 3, 16, 1),
                (
                    R("X", (*a, *b, *t), 1),
                    R("Y", (*d, *b, *a), 1, 1),
                    R("Z", (*a, *b, *t), 2, 2),
                ),
            ),
            ("PREFIX",),
        ),
    ]


#: The scenarios added with the corpus of real bugs (docs/CORPUS.md), which the suite of
#: before did not have.
CORPUS_SCENARIOS = frozenset(s.name for s in (*_key_domains(), *_pressure()))


def _promises() -> list[Scenario]:
    """Situations in which a declared convention promises something (docs/CONFORMANCE.md,
    "Declarations are promises"); every engine runs them, and an engine that declares
    nothing about them passes whatever it chooses."""
    p8 = prompt(120, 8)
    a = (*p8, *prompt(121, 3))
    b = (*p8, *prompt(122, 2))
    return [
        Scenario(
            "promise-same-step-shared-prefix",
            "A and B share a new 8-token prefix (two full blocks) and are admitted in the "
            "same step; D repeats it a step later. An engine declaring same-step prefix "
            "hits holds the prefix in one pair of blocks: the request planned second hits "
            "what the first fills (PREFIX, rule declared-same-step-hits).",
            Workload(
                _cfg(4, 16, 32, 4),
                (R("A", a, 3), R("B", b, 3), R("D", (*p8, *prompt(123, 1)), 2, 1)),
            ),
            ("PREFIX",),
        ),
        Scenario(
            "promise-same-step-hit-within-budget",
            "As above with a budget of 12: A takes 11 tokens, leaving 1. A hit costs no "
            "budget, so an engine declaring same-step hits admits B too, hitting A's two "
            "blocks and computing one token; one without them may wait or chunk.",
            Workload(_cfg(4, 16, 12, 4), (R("A", a, 2), R("B", b, 2))),
            ("PREFIX",),
        ),
    ]


def library() -> list[Scenario]:
    """Every fixed scenario, seeds first."""
    return [
        *_seeds(),
        *_known_bugs(),
        *_key_domains(),
        *_pressure(),
        *_migrations(),
        *_promises(),
    ]


def by_name() -> dict[str, Scenario]:
    return {s.name: s for s in library()}
