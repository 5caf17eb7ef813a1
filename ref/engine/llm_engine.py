"""The engine API: requests in, streamed text and tokens out, the real model underneath.

::

    from refserve.engine.llm_engine import LLMEngine, SamplingParams

    engine = LLMEngine("tiny")                    # or a local HF checkpoint directory
    rid = engine.add_request("Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished:
        for out in engine.step():                 # one scheduler step, one forward
            print(out.request_id, repr(out.new_text), out.finished)

    results = engine.generate(["a", "b"], SamplingParams(max_tokens=4))

A step is :class:`refserve.core.engine_core.EngineCore`'s (schedule, build inputs, execute, commit)
with :class:`refserve.model.executor.ModelExecutor` as the executor, over the model and
tokenizer that :func:`refserve.model.checkpoint.load_model` reads from the ``model`` and
``tokenizer`` arguments; this module adds tokenization, detokenization, stop strings,
``n > 1`` forks and the outputs. Speculative decoding asks any
:class:`~refserve.model.proposers.Proposer` for drafts. Everything
the executor produced reaches the engine through the step's
:class:`~refserve.core.engine_core.StepRecord` (tokens, logprobs, the first tokens of forks),
never through state left on the executor. :meth:`LLMEngine.iter_outputs`,
:meth:`LLMEngine.stream` and :meth:`LLMEngine.generate` are one drive loop
(ref/engine/driving.py) that differs only in which outputs the caller takes and when it
stops.

The engine is its parts, each owning its state: the intake (ref/engine/intake.py: ids,
prompts, stop rules, seeds), the books of every request's samples (samples.py), the
forks of ``n > 1`` requests (fanout.py), what a step means for the sequences
(stepping.py), the outputs and those held (outputs.py), agent turns (turns.py), and
migration's side of it (migration.py, through the engine's public surface:
``books``, ``identity``, ``export_state``, ``source_changed`` and the six calls of
docs/MIGRATION.md).

``n > 1``: the request runs its prompt once. Its last prefill step draws all ``n`` first
tokens from the same logits; sample 0 continues as the request itself and samples
1..n-1 are forked off it (:func:`refserve.kv.forks.fork`: every block shared, the partial last
block copied on the first write), so the prompt's K/V is never recomputed. The fork
happens at a step boundary through :meth:`Scheduler.fork`: the child enters as a running
request in decode or, when ``max_num_seqs`` is reached, waits like a preempted request.
Sample ``i`` has the id ``<request id>#<i>`` inside the engine (scheduler, executor,
metrics); that is why a caller's request id may not contain ``#`` (:data:`FORK_SEPARATOR`).
A request that ends before its first token (abort, queue timeout, capacity) gives a final
output for every one of its ``n`` samples, each with that finish reason and no tokens.

Preemption by swap (``SchedulerConfig.preemption_mode``) needs a host copy of the KV: the
engine builds a :class:`~refserve.model.llama.HostKVCache` of ``num_host_blocks`` blocks and
the executor applies each step's swap copies before the forward; ``swap_out_bytes`` /
``swap_in_bytes`` count the bytes moved.

A hybrid model (sliding-window layers) runs on the plain pool by default: one table
per request, holding every token, that every layer reads (a sliding layer only its
window of it). ``grouped_kv=True``, or a ``SchedulerConfig.kv_groups`` equal to the
model's layout (:func:`refserve.model.config.kv_groups`), runs it on the grouped pool
instead (ref/kv/groups.py): a table per layer group, the window group's blocks freed as
they leave the window; the executor gives each layer its group's tables. Such a pool
swaps to the host only the blocks each group's next query reads (the host cache copies
a block in every layer; only its group's layers read it), takes migrated requests by
recompute, and cuts rejected drafts from every group's table; a ``kv_groups`` other
than the model's is an :class:`InvalidArgument`.

Agent turns (tool waits): :meth:`LLMEngine.pause` stops a decoding request
for a tool call, its KV kept on the device, moved to the host or dropped
(``KVRetention``); :meth:`LLMEngine.resume` appends the tool's output to the
conversation and generates the next turn, which continues from the retained KV (or
recomputes). Outputs are per turn: a resumed turn's ``token_ids`` / ``text`` are that
turn's alone, ``turn`` counts the turns (0 for the first), and ``finished`` is true only
when the request is done for good (a pause ends a turn, not the request).

Faults: one request's fault never stalls or loses another's. A row of logits the sampler
cannot sample (a non-finite value) ends that request alone with the finish reason ``error``:
the step commits for every request (the failed sample's placeholder token included, so the
step stays one transaction), then the request is finished at the step boundary through
:meth:`Scheduler.finish`, the path a stop string takes; the placeholder token is never
shown. Outputs held for the next :meth:`LLMEngine.step` (an abort's final output, the text a
pause flushes) stay held if that step raises, and are delivered, once, by the next step that
returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

import torch

from refserve.core.config import SchedulerConfig
from refserve.core.engine_core import EngineCore, StepRecord
from refserve.core.migration_cost import KVMode, MigrationCost
from refserve.core.policy import Policy
from refserve.core.request import FinishReason, Request, StopParams
from refserve.core.scheduler import Scheduler
from refserve.core.swap import KVRetention
from refserve.core.transit import RequestState
from refserve.engine import driving, migration
from refserve.engine.driving import MAX_IDLE_STEPS, EngineStalled
from refserve.engine.fanout import SampleFanOut
from refserve.engine.intake import FORK_SEPARATOR, Intake, InvalidPrompt, Prompt, sampling_params
from refserve.engine.outputs import GenerationResult, Outputs, RequestOutput, SpeculationStats
from refserve.engine.samples import SampleBook, SampleGroup, sample_spec
from refserve.engine.stepping import Stepper
from refserve.engine.ticket import KVChunk, MigrationTicket, ModelIdentity
from refserve.engine.turns import AgentTurns
from refserve.errors import DuplicateRequest, InvalidArgument, UnknownRequest
from refserve.model.checkpoint import TINY_TRAINED, ModelSource, TokenizerSource, load_model
from refserve.model.config import ModelConfig, describe_layout, kv_groups
from refserve.model.executor import ModelExecutor
from refserve.model.llama import HostKVCache, KVCache
from refserve.model.proposers import Proposer, check_proposer
from refserve.model.sampler import (
    SamplingParams,
    derive_seed,
)
from refserve.spec.events import CacheEvent
from refserve.values import is_int

__all__ = [
    "FORK_SEPARATOR",
    "MAX_IDLE_STEPS",
    "TINY_TRAINED",
    "EngineStalled",
    "GenerationResult",
    "InvalidPrompt",
    "LLMEngine",
    "Prompt",
    "Proposer",
    "RequestOutput",
    "SamplingParams",
    "SpeculationStats",
]


class LLMEngine:
    """A serving engine over the real model; single-threaded, stepped by the caller."""

    def __init__(
        self,
        model: ModelSource = "tiny",
        *,
        tokenizer: TokenizerSource = None,
        scheduler_config: SchedulerConfig | None = None,
        policy: Policy | None = None,
        attention_backend: str = "torch",
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        seed: int = 0,
        model_seed: int = 0,
        check_invariants: bool = False,
        clock: Callable[[], float] | None = None,
        proposer: Proposer | None = None,
        grouped_kv: bool = False,
    ) -> None:
        loaded = load_model(
            model,
            tokenizer=tokenizer,
            attention_backend=attention_backend,
            dtype=dtype,
            device=device,
            seed=model_seed,
        )
        cfg = loaded.config
        self.model_config = cfg
        self.tokenizer = loaded.tokenizer
        self.model = loaded.model
        # Speculative decoding (docs/SPECULATIVE.md): the proposer's k bounds the drafts.
        self.proposer = None if proposer is None else check_proposer(proposer, cfg)
        sched_cfg = _scheduler_config(scheduler_config, cfg, self.proposer, grouped_kv)
        self.scheduler = Scheduler(sched_cfg, policy)
        self.cache = KVCache(
            cfg, sched_cfg.num_blocks, sched_cfg.block_size, dtype=dtype, device=device
        )
        _check_swap_cost(sched_cfg, self.cache.bytes_per_token)
        # The host side of swap, shaped like the device blocks (empty when swap is off).
        self.host_cache = HostKVCache(self.cache, sched_cfg.num_host_blocks)
        self.executor = ModelExecutor(
            self.model, self.cache, self.scheduler.requests, self.host_cache
        )
        self.core = EngineCore(self.scheduler, self.executor, check_invariants=check_invariants)
        self._t0 = time.perf_counter()
        self._clock = clock
        self.intake = Intake(self.tokenizer, cfg, sched_cfg.max_model_len, seed)
        # The engine's parts (module doc): the sample groups of live requests, the forks
        # of n > 1 requests, the outputs (and those held), the step's consequences.
        self.books = SampleBook(self.tokenizer)
        self.fanout = SampleFanOut(self.scheduler, self.executor, self.books)
        self.outputs = Outputs(self.books, self.executor)
        self.stepper = Stepper(
            self.core,
            self.scheduler,
            self.executor,
            self.books,
            self.fanout,
            self.outputs,
            self.proposer,
        )
        self.turns = AgentTurns(
            self.scheduler, self.executor, self.books, self.outputs, self.intake, self.now_ms
        )
        # Migration (docs/MIGRATION.md): requests moved in and out, ms in transit.
        self.num_migrations_in = 0
        self.num_migrations_out = 0
        self.migration_ms = 0.0
        self._identity: ModelIdentity | None = None

    # ------------------------------------------------------------------ requests
    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    @property
    def has_unfinished(self) -> bool:
        """Some request is not finished (a paused one counts) or outputs are held."""
        return bool(self.books) or bool(self.outputs)

    @property
    def has_runnable(self) -> bool:
        """:meth:`step` can make progress: outputs are held, or a live request is not
        paused for a tool (a paused one waits for :meth:`resume`, not for steps)."""
        sched = self.scheduler
        return bool(self.outputs) or len(sched.requests) > len(sched.paused)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The requests live here, in arrival order: not finished (a paused one
        counts), not migrated away, not aborted (the cluster's ownership check,
        ref/cluster/cluster.py)."""
        return self.books.request_ids

    @property
    def paused_request_ids(self) -> tuple[str, ...]:
        """Requests waiting for a tool, in pause order."""
        return tuple(self.scheduler.paused)

    @property
    def swap_out_bytes(self) -> int:
        """KV bytes copied device -> host so far (K and V, every layer)."""
        return self.executor.swap_out_bytes

    @property
    def swap_in_bytes(self) -> int:
        """KV bytes copied host -> device so far."""
        return self.executor.swap_in_bytes

    @property
    def speculation(self) -> SpeculationStats:
        """Drafts verified and accepted so far (speculative decoding)."""
        st = self.stepper
        return SpeculationStats(st.num_verifications, st.num_draft_tokens, st.num_accepted_tokens)

    @property
    def steps(self) -> list[StepRecord]:
        """Every step's record, in order."""
        return self.stepper.steps

    @property
    def num_preemptions(self) -> int:
        return self.stepper.num_preemptions

    @property
    def num_prefix_hit_tokens(self) -> int:
        """Prompt tokens the prefix cache saved, over the engine's life."""
        return self.stepper.num_prefix_hit_tokens

    @property
    def num_forks(self) -> int:
        """Samples of ``n > 1`` requests forked live (ref/engine/fanout.py)."""
        return self.fanout.num_forks

    @property
    def num_draft_tokens(self) -> int:
        return self.stepper.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        return self.stepper.num_accepted_tokens

    @property
    def num_verifications(self) -> int:
        return self.stepper.num_verifications

    def now_ms(self) -> float:
        if self._clock is not None:
            return self._clock()
        return (time.perf_counter() - self._t0) * 1e3

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | Mapping[str, object] | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; return its id. Bad input raises a typed error, changes nothing.

        ``request_id`` (default: ``req-<k>``) must be a non-empty str without ``#``
        (:data:`FORK_SEPARATOR`: the ids ``<id>#<i>`` of samples 1..n-1 are the engine's),
        else :class:`InvalidArgument`; an id in use raises :class:`DuplicateRequest`.
        Sampling options that cannot be sampled raise :class:`InvalidSamplingParams`
        naming the option (``field``), even for a :class:`SamplingParams` altered after
        it was built: it is checked again here.
        """
        sp = sampling_params(params)
        ids = self.intake.prompt_ids(prompt)
        self.intake.check_room(len(ids), "prompt has")
        if not is_int(priority):
            raise InvalidArgument(f"priority must be an int, got {priority!r}")
        rid = self.intake.new_id(request_id, self._in_use)
        child_ids = tuple(f"{rid}{FORK_SEPARATOR}{i}" for i in range(1, sp.n))
        for cid in child_ids:
            if self.books.has_sample(cid) or cid in self.scheduler.requests:
                raise DuplicateRequest(cid, "add_request (n > 1 sample id)")
        stop = self.intake.stop_params(sp)
        # n > 1: the request must survive its first token whatever it is, so the other
        # samples can fork off it; its real stop conditions come back right after.
        first_stop = stop if sp.n == 1 or sp.max_tokens == 1 else StopParams(sp.max_tokens)
        seed = self.intake.seed(sp.seed)
        req = Request(rid, list(ids), first_stop, arrival_ms=self.now_ms(), priority=priority)
        self.scheduler.add_request(req)  # may raise (e.g. ExceedsCapacity): nothing registered
        self.executor.register(
            rid,
            sample_spec(sp, seed),
            tuple(sample_spec(sp, derive_seed(seed, i)) for i in range(1, sp.n)),
        )
        seq = self.books.new_sample(rid, rid, 0, req, sp, ids)
        self.books.open(SampleGroup(rid, sp, stop, tuple(ids), seed, [seq], child_ids))
        return rid

    def abort(self, request_id: str) -> None:
        """Abort every live sample of a request; its final outputs come with the next step.

        Every sample gets one: an ``n > 1`` request aborted before its first token (its
        samples 1..n-1 not forked yet) gives ``n`` final outputs with reason ``abort``.
        """
        group = self.books.group(request_id)
        if group is None:
            raise UnknownRequest(request_id, "abort")
        now = self.now_ms()
        for seq in group.seqs:
            if seq.finished:
                continue
            if seq.seq_id in self.scheduler.requests:
                self.scheduler.abort(seq.seq_id, now)
            seq.finish(FinishReason.ABORT.value, None)
        self.fanout.close_unforked(group, FinishReason.ABORT.value)
        self.outputs.hold(self.outputs.collect([s.seq_id for s in group.seqs]))

    # ------------------------------------------------------------------ agent turns
    def pause(
        self,
        request_id: str,
        retention: KVRetention | str | None = None,
        *,
        expected_wait_ms: float = 0.0,
    ) -> KVRetention:
        """Pause a decoding request for a tool call; return where its KV waits
        (ref/engine/turns.py, ``AgentTurns.pause``)."""
        return self.turns.pause(request_id, retention, expected_wait_ms=expected_wait_ms)

    def resume(
        self,
        request_id: str,
        tool_output: str | Sequence[int],
        params: SamplingParams | Mapping[str, object] | None = None,
    ) -> None:
        """The tool answered: append its output and generate the next turn
        (ref/engine/turns.py, ``AgentTurns.resume``)."""
        self.turns.resume(request_id, tool_output, params)

    # ------------------------------------------------------------------ migration
    def export_request(
        self,
        request_id: str,
        *,
        kv: KVMode | str = KVMode.AUTO,
        inline: bool = True,
        cost: MigrationCost | None = None,
        hit_tokens: int = 0,
        idle: float = 1.0,
    ) -> MigrationTicket:
        """The portable state of a live request, at a step boundary; nothing changes here
        (ref/engine/migration.py, docs/MIGRATION.md). ``kv``: transfer the K/V, recompute it
        on the destination, or ``auto`` (the cost rule, given the destination's
        ``hit_tokens`` and ``idle`` compute); ``inline=False`` leaves the K/V to be streamed
        with :meth:`read_kv`. The request keeps running here until
        :meth:`release_request`."""
        return migration.export(
            self, request_id, kv=kv, inline=inline, cost=cost, hit_tokens=hit_tokens, idle=idle
        )

    def read_kv(self, seq_id: str, start: int, end: int) -> KVChunk:
        """K/V of positions ``[start, end)`` of a live sample, for a streamed migration."""
        return migration.read_kv(self, seq_id, start, end)

    def stage_import(
        self, ticket: MigrationTicket, *, transit_ms: float = 0.0
    ) -> migration.StagedImport:
        """Check a ticket and stage its request here, invisible until the staged
        import's ``commit`` (the protocol of ref/engine/migration.py). Bad tickets raise a
        typed error and change nothing."""
        return migration.stage(self, ticket, transit_ms=transit_ms)

    def import_request(self, ticket: MigrationTicket, *, transit_ms: float = 0.0) -> list[str]:
        """Stage, ack and commit a ticket carrying everything (its K/V inline, or none
        for a recompute) in one call; returns the sample ids now live here. For a ticket
        whose source is gone: with a live source use :func:`refserve.engine.migration.migrate`,
        which releases the source between the ack and the commit."""
        staged = self.stage_import(ticket, transit_ms=transit_ms)
        try:
            staged.ack()
        except BaseException:
            staged.abort()
            raise
        return staged.commit()

    def export_state(self, request_id: str) -> RequestState:
        """The state of the request's first live sample as :meth:`export_request`
        carries it; a pure read (what a destination's prefix hit is probed with)."""
        return migration.export_state(self, request_id)

    def source_changed(self, ticket: MigrationTicket) -> bool:
        """Whether the request of ``ticket`` (exported here) changed since: a sample
        gone, stepped or in another status (docs/MIGRATION.md, "The source changed")."""
        return migration.source_changed(self, ticket)

    @property
    def identity(self) -> ModelIdentity:
        """This engine's network (a ticket from another is refused), computed once."""
        if self._identity is None:
            self._identity = migration.identify_model(self.model_config, self.model, self.cache)
        return self._identity

    def release_request(self, request_id: str) -> None:
        """A migrated request leaves this engine after the destination acknowledged it:
        its blocks are freed and no output of it comes from here any more."""
        migration.release(self, request_id)

    def prefix_hit_tokens(self, token_ids: Sequence[int], state: object = None) -> int:
        """How many of ``token_ids`` this engine's prefix cache holds (full blocks)."""
        if not token_ids:
            return 0
        ns = getattr(state, "namespace", None)
        pool = self.scheduler.pool
        hit = pool.lookup(token_ids) if ns is None else pool.lookup(token_ids, ns)
        return hit.num_tokens

    def cache_events(self) -> list[CacheEvent]:
        """The prefix-cache changes published since the last call, in order
        (``SchedulerConfig.cache_events``; ref/kv/events.py). Each step's are published
        when it commits; a step that fails publishes nothing. Raises
        :class:`InvalidArgument` when the engine was built without them."""
        log = self.scheduler.pool.cache_events
        if log is None:
            raise InvalidArgument(
                "cache_events: this engine publishes none; build it with "
                "SchedulerConfig(cache_events=True)"
            )
        return log.drain()

    @property
    def idle_fraction(self) -> float:
        """The share of the token budget the last step left unused: 1.0 before any step,
        and 1.0 when nothing is left to run (the last step's load has gone with its
        requests; reading it would price a recompute on an empty engine as on a full one,
        docs/MIGRATION.md, "The cost rule")."""
        if not self.steps or not self.scheduler.has_unfinished:
            return 1.0
        plan = self.steps[-1].plan
        used = sum(plan.num_new_tokens) / self.scheduler.config.max_num_batched_tokens
        return max(0.0, 1.0 - used)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the held outputs, then the ones it produced.

        If the step raises, the held outputs (an abort's final output, the text a pause
        flushed) stay held and come with the next step that returns: each is delivered
        exactly once (module doc, "Faults"). The failed step itself was rolled back, its
        K/V writes included (ref/model/executor.py), so stepping again computes the same
        tokens a fault-free run would; a ``KVStateLost`` means the engine must be rebuilt.
        """
        # Step first, take the held outputs after: an exception leaves them queued.
        fresh = self._step() if self.scheduler.has_unfinished else []
        return [*self.outputs.take(), *fresh]

    def _step(self) -> list[RequestOutput]:
        """One step (ref/engine/stepping.py); the outputs of the sequences it touched."""
        return self.stepper.run(self.now_ms())

    def _drive(
        self,
        wants: Callable[[RequestOutput], bool],
        done: Callable[[], bool],
        what: str,
        max_idle_steps: int = MAX_IDLE_STEPS,
    ) -> Iterator[RequestOutput]:
        """The drive loop (ref/engine/driving.py) over this engine."""
        sched = self.scheduler
        return driving.drive(
            self.outputs,
            lambda: sched.has_unfinished,
            self._step,
            wants,
            done,
            what,
            max_idle_steps,
        )

    def iter_outputs(self, *, max_idle_steps: int = MAX_IDLE_STEPS) -> Iterator[RequestOutput]:
        """Step until every request is finished or paused for a tool, yielding each output
        as it appears (held outputs first, before the next step). Returns (rather than
        stepping an idle engine) when only paused requests are left: they wait for
        :meth:`resume`, not for steps."""

        def done() -> bool:
            return not self.has_unfinished or (
                not self.has_runnable and bool(self.scheduler.paused)
            )

        return self._drive(lambda o: True, done, "iter_outputs", max_idle_steps)

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | Mapping[str, object] | None = None,
        *,
        request_id: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Add a request now and iterate over its outputs while stepping the engine.

        Other requests' outputs produced meanwhile are kept for the next :meth:`step`.
        The iteration ends when the request finishes or is paused (:meth:`pause`).
        """
        rid = self.add_request(prompt, params, request_id=request_id)

        def done() -> bool:
            if not self.books.has_request(rid):
                return True
            # Paused for a tool: the stream ends with the turn, once its output is out.
            return rid in self.scheduler.paused and not self.outputs.holds_for(rid)

        return self._drive(lambda o: o.request_id == rid, done, f"stream of request {rid!r}")

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run a batch to completion; results in the order of ``prompts``.

        If any prompt or params is rejected, the requests of this call that were already
        added are aborted and the error is raised; other requests are not touched. If a
        step raises, the requests of this call are aborted too (their outputs dropped),
        the outputs of other requests stay held for :meth:`step`, and the error is
        raised: nothing of another caller's is lost (module doc, "Faults").
        """
        ids = driving.add_batch(self, driving.as_prompt_list(prompts), params)
        wanted = set(ids)
        prompts_of = {rid: self.books.group_of(rid).prompt_token_ids for rid in ids}
        final: dict[str, dict[int, RequestOutput]] = {rid: {} for rid in ids}
        try:
            for o in self._drive(
                lambda o: o.request_id in wanted,
                lambda: not any(self.books.has_request(rid) for rid in ids),
                "generate",
            ):
                if o.finished:
                    final[o.request_id][o.index] = o
        except BaseException:
            driving.drop(self, ids)
            raise
        return [
            GenerationResult(rid, prompts_of[rid], tuple(final[rid][i] for i in sorted(final[rid])))
            for rid in ids
        ]

    # ------------------------------------------------------------------ internals
    def _in_use(self, rid: str) -> bool:
        books = self.books
        return books.has_request(rid) or books.has_sample(rid) or rid in self.scheduler.requests


def _scheduler_config(
    given: SchedulerConfig | None,
    cfg: ModelConfig,
    proposer: Proposer | None,
    grouped_kv: bool = False,
) -> SchedulerConfig:
    """The scheduler's config: the given one (or the defaults) held to the model's
    positions, with the proposer's draft length, and with the model's layer groups when
    ``grouped_kv`` asks for them (a ``kv_groups`` given must be the model's)."""
    sched_cfg = given if given is not None else SchedulerConfig()
    if not isinstance(grouped_kv, bool):
        raise InvalidArgument(f"grouped_kv must be True or False, got {grouped_kv!r}")
    layout = kv_groups(cfg)
    if sched_cfg.kv_groups and sched_cfg.kv_groups != layout:
        raise InvalidArgument(
            f"scheduler_config.kv_groups is {describe_layout(sched_cfg.kv_groups)}, but the "
            f"model's KV layout (refserve.model.config.kv_groups) is {describe_layout(layout)}"
        )
    if grouped_kv and not sched_cfg.kv_groups:
        sched_cfg = replace(sched_cfg, kv_groups=layout)
    if sched_cfg.max_model_len > cfg.max_position_embeddings:
        sched_cfg = replace(sched_cfg, max_model_len=cfg.max_position_embeddings)
    if proposer is not None:
        sched_cfg = replace(sched_cfg, num_speculative_tokens=proposer.num_speculative_tokens)
    return sched_cfg


def _check_swap_cost(sched_cfg: SchedulerConfig, per_token: int) -> None:
    """The recompute-vs-swap rule must price this model's copies, not another's."""
    swap_cost = sched_cfg.swap_cost
    if swap_cost is not None and swap_cost.kv_bytes_per_token != per_token:
        raise InvalidArgument(
            f"swap_cost.kv_bytes_per_token is {swap_cost.kv_bytes_per_token}, but this "
            f"model's K and V take {per_token} bytes per token"
        )
