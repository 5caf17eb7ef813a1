"""A scripted executor with a fake K/V memory (slot -> token id), shared by the
scheduler's state machines (tests/scheduler/test_scheduler_state_machine.py, one engine;
tests/scheduler/test_migration_state_machine.py, a cluster).

The executor samples from per-request scripts (the books' ``next_tokens``), checks that
it is fed each request's own tokens and that every scheduled request reads them back
through its block table, and keeps the memories in the step's transaction
(``begin`` / ``rollback`` / ``commit``, ref/core/executor.py), failing on purpose at a
drawn point (:data:`FAIL_POINTS`). :func:`kv_readback_errors` is the K/V content rule
on the memories after a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from hypothesis import event

from refserve.core.executor import StepOutput
from refserve.core.inputs import ModelInputs
from refserve.core.plan import StepPlan
from refserve.spec import PoolSnapshot
from refserve.spec.arith import blocks_needed, slot_of


class ScriptBooks(Protocol):
    """What the executor reads from a test's books: the memories it writes, the block
    size, each request's known tokens and what its script samples next."""

    memory: dict[int, int]
    host_memory: dict[int, int]

    @property
    def bs(self) -> int: ...

    def tokens(self, rid: str) -> list[int]: ...

    def next_tokens(self, rid: str) -> list[int]: ...


class Boom(Exception):
    """The executor fails on purpose."""


#: Where a failing step fails (ScriptedExecutor.fail_at): before any write, after the
#: swap copies, after the forward's writes, after execute returned its output, or with
#: an output validate_output rejects.
FAIL_POINTS = ("before_execute", "after_swaps", "after_forward", "after_execute", "bad_output")


class ScriptedExecutor:
    """Samples from per-request scripts and keeps a fake KV memory of what it wrote.

    Its memories join the step's transaction like ModelExecutor's K/V: ``begin`` saves
    the old value of every slot the step may write (device and host), ``rollback`` puts
    them back."""

    needs_inputs = True
    transactional_kv = True

    def __init__(self, machine: ScriptBooks) -> None:
        self.m = machine
        self.fail_at: str | None = None
        self.restores = True  # False: a rollback that forgets to restore (the bug)
        self.last: tuple[StepPlan, ModelInputs, dict[str, int]] | None = None
        self.began: StepPlan | None = None
        self._saved: dict[int, int | None] = {}
        self._saved_host: dict[int, int | None] = {}
        self.accepted: dict[str, int] = {}  # the last step's accepted drafts, by request

    def begin(self, plan: StepPlan, inputs: ModelInputs | None) -> None:
        assert inputs is not None
        m, bs = self.m, self.m.bs
        dev = [cp.dst * bs + off for cp in (*plan.swap_in, *plan.copies) for off in range(bs)]
        dev += inputs.slot_mapping.tolist()
        host = [cp.dst * bs + off for cp in plan.swap_out for off in range(bs)]
        self.began = plan
        self._saved = {slot: m.memory.get(slot) for slot in dev}
        self._saved_host = {slot: m.host_memory.get(slot) for slot in host}

    def rollback(self) -> None:
        if self.restores:
            for mem, saved in (
                (self.m.memory, self._saved),
                (self.m.host_memory, self._saved_host),
            ):
                for slot, tok in saved.items():
                    if tok is None:
                        mem.pop(slot, None)
                    else:
                        mem[slot] = tok
        self.commit()

    def commit(self) -> None:
        self._saved, self._saved_host = {}, {}

    def _fail(self, point: str) -> None:
        if self.fail_at == point:
            self.fail_at = None
            raise Boom(f"executor fails on purpose ({point})")

    def execute(self, plan: StepPlan, inputs: ModelInputs | None) -> StepOutput:
        assert inputs is not None
        self._fail("before_execute")
        m = self.m
        bs = m.bs
        assert list(inputs.request_ids) == [c.request_id for c in plan.chunks]
        # The plan's order (ref/core/plan.py): every swap-out, every swap-in, copy-on-write,
        # then the new K/V. Applying them in exactly this order is what makes a device
        # block freed by a swap-out safe to reuse in the same step; any other order, or a
        # host block reused before its swap-in read it, shows up in the read-backs below.
        for cp in plan.swap_out:
            copy_block(m.memory, cp.src, m.host_memory, cp.dst, bs)
        for cp in plan.swap_in:
            copy_block(m.host_memory, cp.src, m.memory, cp.dst, bs)
        for cp in plan.copies:
            event("copy-on-write")
            copy_block(m.memory, cp.src, m.memory, cp.dst, bs)
        self._fail("after_swaps")
        ids = inputs.input_ids.tolist()
        slots = inputs.slot_mapping.tolist()
        qsl = inputs.query_start_loc.tolist()
        for c, lo, hi in zip(plan.chunks, qsl, qsl[1:], strict=False):
            own = [*m.tokens(c.request_id), *c.draft_token_ids]
            # The executor is fed the request's own tokens at its new positions, and a
            # verification its drafts after them.
            assert ids[lo:hi] == own[c.start : c.start + c.num_new_tokens], c
        for slot, tok in zip(slots, ids, strict=True):
            m.memory[slot] = tok
        self._fail("after_forward")
        tables = inputs.block_tables.tolist()
        for i, c in enumerate(plan.chunks):
            end = c.start + c.num_new_tokens
            own = [*m.tokens(c.request_id), *c.draft_token_ids][:end]
            table = tables[i][: blocks_needed(end, bs)]
            got = [m.memory.get(slot_of(table[p // bs], p, bs)) for p in range(end)]
            assert got == own, f"{c.request_id} reads {got} through {table}, owns {own}"
        # The script is the target model, greedy: a draft is accepted while it is the
        # script's next token, and the token sampled is the script's after them.
        self.accepted = {
            c.request_id: accepted_drafts(c.draft_token_ids, m.next_tokens(c.request_id))
            for c in plan.chunks
            if c.draft_token_ids
        }
        sampled = {
            c.request_id: m.next_tokens(c.request_id)[self.accepted.get(c.request_id, 0)]
            for c in plan.chunks
            if c.samples
        }
        if self.fail_at == "bad_output" and sampled:
            self.fail_at = None
            event("failed step: output rejected")
            if self.accepted:  # an accepted count past the drafts, or a bad token
                rid, a = next(iter(self.accepted.items()))
                return StepOutput(sampled, 1.0, accepted={**self.accepted, rid: a + 99})
            return StepOutput({**sampled, next(iter(sampled)): -1}, 1.0)
        # A step that samples nothing has no output to spoil: fail after it instead.
        self.fail_at = "after_execute" if self.fail_at == "bad_output" else self.fail_at
        self.last = (plan, inputs, sampled)
        self._fail("after_execute")
        return StepOutput(sampled, 1.0, accepted=self.accepted)


def copy_block(
    src_mem: dict[int, int], src: int, dst_mem: dict[int, int], dst: int, bs: int
) -> None:
    """Copy all ``bs`` slots of one block; an unwritten slot stays unwritten."""
    for off in range(bs):
        tok = src_mem.get(src * bs + off)
        if tok is None:
            dst_mem.pop(dst * bs + off, None)
        else:
            dst_mem[dst * bs + off] = tok


def kv_readback_errors(
    pool: PoolSnapshot,
    host: PoolSnapshot,
    memory: dict[int, int],
    host_memory: dict[int, int],
    tokens: Callable[[str], list[int]],
) -> list[str]:
    """The K/V content rule on the fake memories: every live device table, every
    prefix-cache entry and every host table reads back exactly the tokens it claims."""
    bs = pool.block_size
    errors: list[str] = []
    for t in pool.tables:
        own = tokens(t.request_id)[: t.num_stored]
        got = [memory.get(slot_of(t.block_table[p // bs], p, bs)) for p in range(len(own))]
        if got != own:
            errors.append(f"{t.request_id} reads {got}, owns {own}")
    for e in pool.cache_entries:
        got = [memory.get(e.block_id * bs + off) for off in range(bs)]
        if got != list(e.token_ids):
            errors.append(f"cache entry of block {e.block_id} is stale: {got} != {e.token_ids}")
    for t in host.tables:
        own = tokens(t.request_id)[: t.num_stored]
        if list(t.token_ids) != own:
            errors.append(f"host table of {t.request_id} claims {t.token_ids}, owns {own}")
        got = [host_memory.get(slot_of(t.block_table[p // bs], p, bs)) for p in range(len(own))]
        if got != own:
            errors.append(f"{t.request_id} reads {got} from the host, owns {own}")
    return errors


def accepted_drafts(drafts: tuple[int, ...], target: list[int]) -> int:
    """How many leading drafts equal the target's tokens."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n
