"""The self-check's semantic checks: the request's counters and status (KVLEN), its
positions and slots (POS), its table and the free queue (BLOCK, POS), the finish and
the pool at the end (PROGRESS), each explained in the terms of the protocol."""

from __future__ import annotations

from refserve.conformance.adapter import (
    DEFAULT_PROPERTIES,
    CommitReport,
    EngineProperties,
    StepReport,
)
from refserve.conformance.selfcheck.explain import Report
from refserve.conformance.selfcheck.protocol import (
    CONFIG,
    REQUEST,
    ExpectedState,
    span_text,
    tuple_text,
)
from refserve.spec.arith import blocks_needed, slot_of
from refserve.spec.snapshot import (
    EngineSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    TableSnapshot,
)


def find_request(snap: EngineSnapshot) -> RequestSnapshot | None:
    """The self-check's request in ``snap`` (None when it is not listed)."""
    for r in snap.requests:
        if getattr(r, "request_id", None) == REQUEST.request_id:
            return r
    return None


def find_table(snap: EngineSnapshot) -> TableSnapshot | None:
    """The self-check's request's table in ``snap`` (None when it holds none)."""
    for t in snap.pool.tables:
        if getattr(t, "request_id", None) == REQUEST.request_id:
            return t
    return None


class ScheduleChecks:
    """The request's entry of each step report compared, field by field, with what the
    protocol implies (:class:`ExpectedState`, the self-check's own oracle): its counts
    (KVLEN), positions and slots (POS), its table's growth and the free queue (BLOCK)."""

    def __init__(self, report: Report, model: ExpectedState) -> None:
        self.report = report
        self.model = model
        self.props: EngineProperties = DEFAULT_PROPERTIES
        """The adapter's declared properties, once read."""

    def check_schedule(
        self, rep: StepReport, before: EngineSnapshot, entry: ScheduledRequest | None
    ) -> None:
        """A's entry of the step report, every field compared with the protocol."""
        retired = self.check_others(rep)
        if entry is None:
            if REQUEST.request_id not in retired:
                self.report.fail(
                    f"schedule() gave {REQUEST.request_id} nothing although it is runnable, "
                    f"alone, and the pool ({CONFIG.num_blocks} blocks) and budget "
                    f"({CONFIG.max_num_batched_tokens} tokens) have room (PROGRESS)"
                )
            return
        start = self.model.computed + entry.num_new_cached_tokens
        self.check_counts(entry, start)
        self.check_positions(entry, start)
        self.check_slots(entry)
        self.check_growth(entry.block_table, before)
        self.check_samples(entry, start)
        if self.props.free_queue_order:
            self.check_free_order(before, entry.block_table)

    def check_others(self, rep: StepReport) -> dict[str, str]:
        """Nothing but A is scheduled; A is neither preempted nor retired while planning.
        Returns the requests the plan retired, with their reasons."""
        rid = REQUEST.request_id
        for s in rep.scheduled:
            if s.request_id != rid:
                self.report.fail(
                    f"schedule() scheduled {s.request_id!r}, a request that was never added"
                )
        if rid in rep.preempted:
            self.report.fail(
                f"schedule() preempted {rid} although it is the only request and the pool "
                f"has {CONFIG.num_blocks} blocks: preempt only when the pool runs out"
            )
        retired = {str(f[0]): str(f[1]) for f in rep.finished}
        if rid in retired:
            self.report.fail(
                f"schedule() retired {rid} (reason {retired[rid]!r}) while planning, after "
                f"{self.model.outputs} of {REQUEST.max_tokens} outputs: nothing stops it yet"
            )
        return retired

    def check_counts(self, s: ScheduledRequest, start: int) -> None:
        """KVLEN: no cache hit in a fresh engine; at least one new token, no more than
        are known and left to compute, and within the budget."""
        n, known = s.num_new_tokens, len(self.model.tokens)
        if s.num_new_cached_tokens:
            self.report.fail(
                f"num_new_cached_tokens is {s.num_new_cached_tokens}, but nothing is cached in "
                "a fresh engine: it counts prompt tokens served from the prefix cache when "
                "this step admits the request"
            )
        if n < 1:
            self.report.fail(
                f"num_new_tokens is {n}: a request listed in StepReport.scheduled gets at "
                "least one token (leave out a request that gets none)"
            )
        elif start + n > known:
            self.report.fail(
                f"num_new_tokens is {n} but only {known - start} of {REQUEST.request_id}'s "
                f"{known} known tokens are left to compute (KV for positions "
                f"0..{start - 1} exists)"
            )
        if n > CONFIG.max_num_batched_tokens:
            self.report.fail(
                f"num_new_tokens {n} exceeds the budget {CONFIG.max_num_batched_tokens}"
            )

    def check_positions(self, s: ScheduledRequest, start: int) -> None:
        """POS: the positions continue the KV already computed, contiguously."""
        expected = tuple(range(start, start + s.num_new_tokens))
        if s.positions == expected:
            return
        first = s.positions[0] if s.positions else None
        if first is not None and first == start + 1:
            hint = (
                "; off by one: a token's position is its index in prompt + outputs, "
                "from 0, and the first new token of a decode is the last sampled one, "
                "at num_tokens - 1"
            )
        elif first is not None and first != start:
            hint = f"; they must start at num_computed_tokens = {start}"
        else:
            hint = "; they must be contiguous"
        self.report.fail(
            f"positions are {span_text(s.positions)}, expected {span_text(expected)}: positions "
            f"continue from the KV already computed, {start} tokens{hint}"
        )

    def check_slots(self, s: ScheduledRequest) -> None:
        """POS: each slot is ``block_table[pos // bs] * bs + pos % bs``; the first wrong
        one is explained."""
        table, bs = s.block_table, CONFIG.block_size
        for i, (pos, slot) in enumerate(zip(s.positions, s.slot_mapping, strict=False)):
            if pos // bs >= len(table):
                self.report.fail(
                    f"position {pos} lies beyond the block table {tuple_text(table)} "
                    f"(covers positions 0..{len(table) * bs - 1}): the table sent with the "
                    "step must already hold the blocks this step writes"
                )
                return
            want = slot_of(table[pos // bs], pos, bs)
            if slot != want:
                hint = " (looks like the position itself)" if slot == pos and pos != want else ""
                self.report.fail(
                    f"slot_mapping[{i}] is {slot} for position {pos}; the slot of a position "
                    f"is block_table[pos // {bs}] * {bs} + pos % {bs} = "
                    f"{table[pos // bs]} * {bs} + {pos % bs} = {want}{hint}"
                )
                return

    def check_growth(self, table: tuple[int, ...], before: EngineSnapshot) -> None:
        """BLOCK: the step's table names pool blocks and extends the one held before."""
        out_of_pool = [b for b in table if b >= CONFIG.num_blocks]
        if out_of_pool:
            self.report.fail(
                f"block table {tuple_text(table)} names blocks {out_of_pool} outside the pool"
            )
        held_before = find_table(before)
        if held_before is None:
            return
        prev = tuple(held_before.block_table)
        if tuple(table[: len(prev)]) != prev:
            self.report.fail(
                f"block table {tuple_text(table)} does not start with the table "
                f"{REQUEST.request_id} held before the step {tuple_text(prev)}: a request keeps "
                "its blocks in order and only appends"
            )

    def check_samples(self, s: ScheduledRequest, start: int) -> None:
        """KVLEN: ``samples`` is set exactly when the chunk reaches the last known token."""
        n, known = s.num_new_tokens, len(self.model.tokens)
        reaches_end = start + n == known
        if s.samples is reaches_end or not isinstance(s.samples, bool):
            return
        if reaches_end:
            self.report.fail(
                f"samples is False, but the chunk reaches the last known token "
                f"({start} + {n} == num_tokens {known}): the model samples after it"
            )
        else:
            self.report.fail(
                f"samples is True, but the chunk ends at position {start + n - 1}, short "
                f"of the last known token (position {known - 1}): a chunk that stops "
                "inside the prompt has no logit worth sampling"
            )

    def check_free_order(self, before: EngineSnapshot, table: tuple[int, ...]) -> None:
        held = find_table(before)
        already = set(held.block_table) if held is not None else set()
        new = [b for b in table if b not in already]
        head = list(before.pool.free_queue[: len(new)])
        if new and sorted(new) != sorted(head):
            self.report.fail(
                f"new blocks {new} were not taken from the head of the free queue "
                f"{tuple_text(before.pool.free_queue[: len(new) + 2])}...: the free queue "
                "lists free blocks in the order the engine hands them out (declare "
                "EngineProperties(free_queue_order=False) if its free list has no order)"
            )


class StateChecks:
    """Each snapshot and commit report compared with what the protocol implies: the
    pool's shape, the request's counters and status (KVLEN), its table (BLOCK, POS), the
    finish and the pool at the end (PROGRESS)."""

    def __init__(self, report: Report, model: ExpectedState) -> None:
        self.report = report
        self.model = model
        self.props: EngineProperties = DEFAULT_PROPERTIES
        """The adapter's declared properties, once read."""

    def check_pool_shape(self, snap: EngineSnapshot) -> None:
        pool = snap.pool
        c = CONFIG
        if pool.num_blocks != c.num_blocks or pool.block_size != c.block_size:
            self.report.fail(
                f"snapshot.pool has {pool.num_blocks} blocks of block size {pool.block_size}, "
                f"but configure() asked for {c.num_blocks} blocks of {c.block_size}: report "
                "the pool the engine was configured with (num_blocks, block_size)"
            )
        else:
            self.report.ok(
                f"snapshot.pool ({pool.num_blocks} blocks, block size {pool.block_size})"
            )
        held = [b for b, rc in enumerate(pool.ref_cnt) if rc != 0]
        missing = sorted(set(range(pool.num_blocks)) - set(pool.free_queue))
        if held or missing or pool.tables:
            self.report.fail(
                "a fresh engine with one waiting request holds no block: every ref_cnt is 0 "
                "and the free queue lists every block"
                + (f"; ref_cnt is non-zero for blocks {held}" if held else "")
                + (f"; the free queue lacks blocks {missing}" if missing else "")
                + (
                    f"; tables are listed for {[t.request_id for t in pool.tables]}"
                    if pool.tables
                    else ""
                )
            )
        else:
            self.report.ok(f"all {pool.num_blocks} blocks free, in the free queue")

    def check_waiting(self, snap: EngineSnapshot) -> None:
        rid = REQUEST.request_id
        r = find_request(snap)
        if r is None:
            self.report.fail(
                f"request {rid} is missing from the snapshot after add_request: a snapshot "
                "lists every live request, waiting ones included"
            )
            return
        mark = len(self.report.problems)
        if r.status != RequestStatus.WAITING:
            self.report.fail(
                f"{rid} is {r.status} before any schedule(); a request not yet scheduled "
                "is waiting (prefilling starts with its first chunk)"
            )
        self.counters(r, outputs=0, computed=0)
        if not self.report.failed_since(mark):
            self.report.ok(
                f"{rid} is listed: waiting, {r.num_prompt_tokens} prompt tokens, "
                f"num_computed_tokens 0, max_tokens {r.max_tokens}"
            )

    def counters(self, r: RequestSnapshot, *, outputs: int, computed: int) -> None:
        rid = REQUEST.request_id
        n_prompt = len(REQUEST.prompt_token_ids)
        if r.num_prompt_tokens != n_prompt:
            self.report.fail(
                f"{rid}.num_prompt_tokens is {r.num_prompt_tokens}, expected {n_prompt}: it "
                "counts the prompt only (outputs are num_output_tokens; num_tokens is both)"
            )
        if r.num_output_tokens != outputs:
            self.report.fail(
                f"{rid}.num_output_tokens is {r.num_output_tokens}, expected {outputs}: it "
                "counts the tokens sampled so far (one per commit that gave it a token)"
            )
        if r.num_computed_tokens != computed:
            hint = ""
            if r.num_computed_tokens == n_prompt + outputs and outputs:
                hint = "; it counts the last sampled token, whose K/V is written only next step"
            self.report.fail(
                f"{rid}.num_computed_tokens is {r.num_computed_tokens}, expected {computed}: it "
                "is the KV length, the tokens whose K/V the steps so far wrote (the prompt "
                "chunks, then one per decode)" + hint
            )
        if r.max_tokens != REQUEST.max_tokens:
            self.report.fail(
                f"{rid}.max_tokens is {r.max_tokens}, expected {REQUEST.max_tokens} "
                "(RequestSpec.max_tokens as given)"
            )

    def check_finish(self, rep: StepReport, done: CommitReport, what: str) -> None:
        m = self.model
        rid = REQUEST.request_id
        reasons = {str(f[0]): str(f[1]) for f in (*rep.finished, *done.finished)}
        for other in sorted(set(reasons) - {rid}):
            self.report.fail(f"{what} reported {other!r} finished, a request that was never added")
        must = m.outputs >= REQUEST.max_tokens
        # The engine's word ends the request either way: later checks then ask whether it
        # is consistently over (listed finished, blocks freed), not for more of the same.
        m.finished = must or rid in reasons
        if must and rid not in reasons:
            self.report.fail(
                f"{what} did not report {rid} finished, although it sampled output "
                f"{m.outputs} of max_tokens {REQUEST.max_tokens}: return "
                f"CommitReport(finished=(({rid!r}, 'length'),))"
            )
            return
        if not must and rid in reasons:
            self.report.fail(
                f"{rid} was reported finished (reason {reasons[rid]!r}) after {m.outputs} of "
                f"max_tokens {REQUEST.max_tokens} outputs, without sampling eos"
            )
            return
        if must:
            if reasons[rid] != "length":
                self.report.fail(
                    f"{rid} finished with reason {reasons[rid]!r}; a request that reached "
                    "max_tokens finishes with 'length' ('stop' means eos or a stop token)"
                )
            else:
                self.report.ok(f"{what}: {rid} finished, reason 'length' (max_tokens reached)")
        else:
            self.report.ok(
                f"{what}: {rid} not finished ({m.outputs} of {REQUEST.max_tokens} outputs)"
            )

    def check_after(
        self, snap: EngineSnapshot, entry: ScheduledRequest | None, *, reached_end: bool
    ) -> None:
        m = self.model
        rid = REQUEST.request_id
        mark = len(self.report.problems)
        for x in snap.requests:
            if getattr(x, "request_id", None) != rid:
                self.report.fail(
                    f"the snapshot lists {x.request_id!r}, a request that was never added"
                )
        r = find_request(snap)
        t = find_table(snap)
        if r is None:
            if m.finished:
                self.report.fail(
                    f"{rid} finished in this step but is missing from the snapshot after "
                    "commit(): a finished request stays listed, status finished, until the "
                    "next schedule() begins"
                )
            else:
                self.report.fail(
                    f"request {rid} is missing from the snapshot: a snapshot lists every live "
                    "request (plus those finished or aborted since the last schedule began)"
                )
            return
        if m.finished:
            self.check_finished(r, t, mark)
            return
        want, why = self.expected_status()
        if r.status != want:
            self.report.fail(f"{why}; the snapshot says {r.status}")
        self.counters(r, outputs=m.outputs, computed=m.computed)
        self.check_table(snap, r, t, entry)
        if not self.report.failed_since(mark):
            assert t is not None  # check_table failed otherwise
            kv = (
                f" == num_tokens {r.num_tokens} - 1"
                if want is RequestStatus.DECODING
                else f" of {r.num_tokens}"
            )
            self.report.ok(
                f"snapshot: {rid} {r.status}, num_computed_tokens {r.num_computed_tokens}{kv}"
                f"; table {tuple_text(t.block_table)} stores {t.num_stored} tokens"
            )

    def check_finished(self, r: RequestSnapshot, t: TableSnapshot | None, mark: int) -> None:
        """A request that finished in this step is listed finished, with all its outputs
        and no table (its blocks went back to the pool at once)."""
        rid, outputs = REQUEST.request_id, self.model.outputs
        if r.status != RequestStatus.FINISHED:
            self.report.fail(f"{rid} finished in this step but the snapshot says {r.status}")
        if r.num_output_tokens != outputs:
            self.report.fail(
                f"{rid}.num_output_tokens is {r.num_output_tokens}, expected {outputs}"
            )
        if t is not None:
            self.report.fail(
                f"{rid} finished but still has a table {tuple_text(t.block_table)}: a finished "
                "request's blocks go back to the pool at once"
            )
        if not self.report.failed_since(mark):
            self.report.ok(f"snapshot: {rid} finished, {r.num_output_tokens} outputs, no table")

    def expected_status(self) -> tuple[RequestStatus, str]:
        """The status a live request has after this step (KVLEN: decoding exactly when
        ``num_computed_tokens == num_tokens - 1`` after a sample), and why."""
        m = self.model
        known = len(m.tokens)
        if m.computed == known - 1 and m.outputs:
            why = (
                "after a chunk that reached the end of the prompt and sampled, the request "
                "should be decoding"
                if m.outputs == 1
                else "after a decode step the request stays decoding"
            )
            why += f" with num_computed_tokens == num_tokens - 1 ({m.computed} == {known} - 1)"
            return RequestStatus.DECODING, why
        return RequestStatus.PREFILLING, (
            f"after a chunk that stopped inside the prompt ({m.computed} of {known} tokens "
            "computed) the request should be prefilling"
        )

    def check_table(
        self,
        snap: EngineSnapshot,
        r: RequestSnapshot,
        t: TableSnapshot | None,
        entry: ScheduledRequest | None,
    ) -> None:
        m = self.model
        rid = REQUEST.request_id
        bs = CONFIG.block_size
        if t is None:
            if r.num_computed_tokens > 0 or m.computed > 0:
                self.report.fail(
                    f"{rid} has KV ({m.computed} tokens) but snapshot.pool.tables has no "
                    "table for it: list one TableSnapshot per request holding blocks"
                )
            return
        if t.num_stored != r.num_computed_tokens:
            self.report.fail(
                f"the table's num_stored is {t.num_stored} but {rid}.num_computed_tokens is "
                f"{r.num_computed_tokens}: num_stored is the KV length the table holds, the "
                "same count"
            )
        want_tokens = tuple(m.tokens[: t.num_stored])
        if tuple(t.token_ids) != want_tokens:
            self.report.fail(
                f"the table's token_ids are {tuple_text(tuple(t.token_ids))}, expected "
                f"{tuple_text(want_tokens)}: the token ids whose K/V sits at positions "
                f"0..{t.num_stored - 1}, prompt then outputs"
            )
        need = blocks_needed(t.num_stored, bs)
        most = blocks_needed(t.num_stored + self.props.lookahead_slots, bs)
        held = len(t.block_table)
        if held < need:
            self.report.fail(
                f"the table holds {held} blocks, too few for num_stored {t.num_stored} "
                f"(ceil({t.num_stored} / {bs}) = {need})"
            )
        elif held > most:
            look = self.props.lookahead_slots
            self.report.fail(
                f"the table holds {held} blocks but num_stored {t.num_stored} needs {need} "
                f"(ceil({t.num_stored} / {bs})); a table may hold at most "
                f"ceil((num_stored + lookahead_slots) / block_size) = {most} with the declared "
                f"lookahead_slots {look}. An engine that reserves slots ahead (e.g. for the "
                "token it samples) declares EngineProperties(lookahead_slots=k)"
            )
        if entry is not None:
            k = min(need, len(entry.block_table))
            if tuple(t.block_table[:k]) != tuple(entry.block_table[:k]):
                self.report.fail(
                    f"the table after the step {tuple_text(t.block_table)} differs from the block "
                    f"table schedule() reported {tuple_text(entry.block_table)}: both are the same "
                    "request's table"
                )
        pool = snap.pool
        free = set(pool.free_queue)
        for b in t.block_table:
            if not 0 <= b < len(pool.ref_cnt):
                continue  # reported by validate
            if pool.ref_cnt[b] < 1:
                self.report.fail(
                    f"block {b} of {rid}'s table has ref_cnt {pool.ref_cnt[b]}: ref_cnt counts "
                    "the tables holding a block"
                )
            if b in free:
                self.report.fail(
                    f"block {b} of {rid}'s table is in the free queue: a held block is not free"
                )

    def check_all_free(self, snap: EngineSnapshot) -> None:
        pool = snap.pool
        held = [b for b, rc in enumerate(pool.ref_cnt) if rc != 0]
        missing = sorted(set(range(pool.num_blocks)) - set(pool.free_queue))
        mark = len(self.report.problems)
        if held:
            self.report.fail(
                f"blocks not freed at the end: ref_cnt is non-zero for blocks {held} after "
                "the only request finished (a leak: the pool shrinks with every request)"
            )
        if missing:
            self.report.fail(
                f"the free queue lacks blocks {missing} after the only request finished: a "
                "block no request holds is free, whether or not the prefix cache still "
                "indexes it (it is evictable)"
            )
        others = [x.request_id for x in pool.tables]
        if others:
            self.report.fail(
                f"tables are still listed for {others} after the only request finished"
            )
        if not self.report.failed_since(mark):
            self.report.ok(
                f"all {pool.num_blocks} blocks free again (ref_cnt 0, in the free queue)"
            )
