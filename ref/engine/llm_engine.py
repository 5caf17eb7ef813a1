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
(``_drive``) that differs only in which outputs the caller takes and when it stops.

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

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch

from refserve.core.config import SchedulerConfig
from refserve.core.engine_core import EngineCore, StepRecord
from refserve.core.executor import DrawnToken
from refserve.core.migration_cost import KVMode, MigrationCost
from refserve.core.outcome import Outcome
from refserve.core.policy import Policy
from refserve.core.request import FinishReason, Request, StopParams, check_room_for_output
from refserve.core.scheduler import Scheduler
from refserve.core.swap import KVRetention
from refserve.engine import migration
from refserve.engine.samples import Sample, SampleGroup, sample_spec
from refserve.engine.ticket import KVChunk, MigrationTicket, ModelIdentity
from refserve.errors import DuplicateRequest, InvalidArgument, RefserveError, UnknownRequest
from refserve.model.checkpoint import TINY_TRAINED, ModelSource, TokenizerSource, load_model
from refserve.model.executor import ModelExecutor
from refserve.model.llama import HostKVCache, KVCache
from refserve.model.proposers import Proposer, check_proposer
from refserve.model.sampler import (
    InvalidSamplingParams,
    SamplingParams,
    derive_seed,
    mix64,
    sample_failed,
)
from refserve.model.tokenizer import TextStream
from refserve.sim.metrics import RequestMetrics
from refserve.spec.events import CacheEvent
from refserve.spec.snapshot import RequestStatus

__all__ = [
    "TINY_TRAINED",
    "GenerationResult",
    "InvalidPrompt",
    "LLMEngine",
    "Proposer",
    "RequestOutput",
    "SamplingParams",
]

Prompt = str | Sequence[int]

#: Joins a request id and a sample index into the internal id of samples 1..n-1
#: (``"x#2"``); caller-chosen request ids may not contain it, so no caller id can ever
#: name a sample that another request is about to fork.
FORK_SEPARATOR = "#"


class InvalidPrompt(InvalidArgument):
    """The prompt is empty, too long, or has token ids outside the vocabulary."""


class EngineStalled(RefserveError):
    """Steps keep scheduling nothing while requests are unfinished (a scheduler bug)."""


#: How many passes of a drive loop in a row may produce no output before it raises
#: :class:`EngineStalled` (:meth:`LLMEngine.iter_outputs`, ``stream``, ``generate``).
MAX_IDLE_STEPS = 10_000


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one sequence (``index`` is the sample, 0..n-1).

    ``new_*`` fields are this step's delta; ``text`` / ``token_ids`` are cumulative over
    the current turn (``turn``: 0, then one more after each :meth:`LLMEngine.resume`).
    ``text`` may lag ``token_ids`` by a few characters while they could still be the
    start of a stop string, or while a UTF-8 character is incomplete; the output that
    :meth:`LLMEngine.pause` queues carries that held-back text (no new tokens).
    """

    request_id: str
    index: int
    new_text: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...] | None
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    metrics: RequestMetrics
    turn: int = 0


@dataclass(frozen=True)
class GenerationResult:
    """A finished request of :meth:`LLMEngine.generate`: one final output per sample."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[RequestOutput, ...]


@dataclass(frozen=True)
class SpeculationStats:
    """Speculative decoding over an engine's life (docs/SPECULATIVE.md): verifications
    (a request's step with drafts), drafts verified and drafts accepted."""

    num_verifications: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified drafts; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted(self) -> float | None:
        """Drafts accepted per verification (each also emits one token of the target's)."""
        n = self.num_verifications
        return self.num_accepted_tokens / n if n else None

    def __str__(self) -> str:
        rate = self.acceptance_rate
        shown = "n/a" if rate is None else f"{100 * rate:.1f} %"
        return (
            f"{self.num_accepted_tokens} of {self.num_draft_tokens} drafts accepted ({shown}) "
            f"in {self.num_verifications} verifications"
        )


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
        sched_cfg = scheduler_config if scheduler_config is not None else SchedulerConfig()
        if sched_cfg.max_model_len > cfg.max_position_embeddings:
            sched_cfg = replace(sched_cfg, max_model_len=cfg.max_position_embeddings)
        # Speculative decoding (docs/SPECULATIVE.md): the proposer's k bounds the drafts.
        self.proposer = None if proposer is None else check_proposer(proposer, cfg)
        if self.proposer is not None:
            k = self.proposer.num_speculative_tokens
            sched_cfg = replace(sched_cfg, num_speculative_tokens=k)
        self.scheduler = Scheduler(sched_cfg, policy)
        self.cache = KVCache(
            cfg, sched_cfg.num_blocks, sched_cfg.block_size, dtype=dtype, device=device
        )
        swap_cost = sched_cfg.swap_cost
        per_token = self.cache.bytes_per_token
        if swap_cost is not None and swap_cost.kv_bytes_per_token != per_token:
            # The recompute-vs-swap rule would price copies of a different model.
            raise InvalidArgument(
                f"swap_cost.kv_bytes_per_token is {swap_cost.kv_bytes_per_token}, but this "
                f"model's K and V take {per_token} bytes per token"
            )
        # The host side of swap, shaped like the device blocks (empty when swap is off).
        self.host_cache = HostKVCache(self.cache, sched_cfg.num_host_blocks)
        self.executor = ModelExecutor(
            self.model, self.cache, self.scheduler.requests, self.host_cache
        )
        self.core = EngineCore(self.scheduler, self.executor, check_invariants=check_invariants)
        self._rng = random.Random(seed)
        self._t0 = time.perf_counter()
        self._clock = clock
        self._groups: dict[str, SampleGroup] = {}
        self._seqs: dict[str, Sample] = {}
        self._inbox: list[RequestOutput] = []
        self._next_id = 0
        self.steps: list[StepRecord] = []
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.num_forks = 0
        # Speculative decoding, over the engine's life (docs/SPECULATIVE.md).
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0
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
        return bool(self._groups) or bool(self._inbox)

    @property
    def has_runnable(self) -> bool:
        """:meth:`step` can make progress: outputs are held, or a live request is not
        paused for a tool (a paused one waits for :meth:`resume`, not for steps)."""
        sched = self.scheduler
        return bool(self._inbox) or len(sched.requests) > len(sched.paused)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The requests live here, in arrival order: not finished (a paused one
        counts), not migrated away, not aborted (the cluster's ownership check,
        ref/cluster/cluster.py)."""
        return tuple(self._groups)

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
        return SpeculationStats(
            self.num_verifications, self.num_draft_tokens, self.num_accepted_tokens
        )

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
        sp = _sampling_params(params)
        ids = self._prompt_ids(prompt)
        self._check_room(len(ids), "prompt has")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidArgument(f"priority must be an int, got {priority!r}")
        rid = self._new_id(request_id)
        child_ids = tuple(f"{rid}{FORK_SEPARATOR}{i}" for i in range(1, sp.n))
        for cid in child_ids:
            if cid in self._seqs or cid in self.scheduler.requests:
                raise DuplicateRequest(cid, "add_request (n > 1 sample id)")
        stop = self._stop_params(sp)
        # n > 1: the request must survive its first token whatever it is, so the other
        # samples can fork off it; its real stop conditions come back right after.
        first_stop = stop if sp.n == 1 or sp.max_tokens == 1 else StopParams(sp.max_tokens)
        seed = sp.seed if sp.seed is not None else self._rng.randrange(1 << 62)
        req = Request(rid, list(ids), first_stop, arrival_ms=self.now_ms(), priority=priority)
        self.scheduler.add_request(req)  # may raise (e.g. ExceedsCapacity): nothing registered
        self.executor.register(
            rid,
            sample_spec(sp, seed),
            tuple(sample_spec(sp, derive_seed(seed, i)) for i in range(1, sp.n)),
        )
        seq = self._new_seq(rid, rid, 0, req, sp, ids)
        self._groups[rid] = SampleGroup(rid, sp, stop, tuple(ids), seed, [seq], child_ids)
        return rid

    def abort(self, request_id: str) -> None:
        """Abort every live sample of a request; its final outputs come with the next step.

        Every sample gets one: an ``n > 1`` request aborted before its first token (its
        samples 1..n-1 not forked yet) gives ``n`` final outputs with reason ``abort``.
        """
        group = self._groups.get(request_id)
        if group is None:
            raise UnknownRequest(request_id, "abort")
        now = self.now_ms()
        for seq in group.seqs:
            if seq.finished:
                continue
            if seq.seq_id in self.scheduler.requests:
                self.scheduler.abort(seq.seq_id, now)
            self._finish(seq, FinishReason.ABORT.value, None)
        self._close_unforked(group, FinishReason.ABORT.value)
        self._inbox.extend(self._collect([s.seq_id for s in group.seqs]))

    # ------------------------------------------------------------------ agent turns
    def pause(
        self,
        request_id: str,
        retention: KVRetention | str | None = None,
        *,
        expected_wait_ms: float = 0.0,
    ) -> KVRetention:
        """Pause a decoding request for a tool call (an agent turn); return where
        its KV waits (``KVRetention``: ``device``, ``host`` or ``drop``; ``None`` lets
        ``SchedulerConfig.retention`` choose from ``expected_wait_ms``).

        The current turn ends here: its text stream is flushed (text held back for a
        possible stop string is released: the turn ended without one) and one output with
        no new tokens carries that text, delivered by the next :meth:`step`. A paused
        request then produces nothing until :meth:`resume`; it is not finished
        (``has_unfinished`` stays true) but needs no steps (``has_runnable`` ignores it,
        and :meth:`iter_outputs` returns when only paused requests are left).
        :meth:`abort` ends it like any live request. With ``host`` the KV moves in the
        next :meth:`step` (the executor copies it even if that step schedules nothing).

        Only ``n == 1`` requests pause, and only while decoding (a request just preempted
        waits to be re-admitted first). Bad input raises a typed error (unknown id:
        :class:`UnknownRequest`; ``n > 1``, not decoding, already paused, ``host`` with no
        host pool, a bad retention: :class:`InvalidArgument`) and changes nothing.
        """
        group = self._groups.get(request_id)
        if group is None:
            raise UnknownRequest(request_id, "pause")
        if group.params.n != 1:
            raise InvalidArgument(
                f"pause: request {request_id!r} has n={group.params.n}; only n == 1 requests "
                "pause for a tool"
            )
        seq = group.seqs[0]
        if seq.finished or request_id not in self.scheduler.requests:
            raise InvalidArgument(f"pause: request {request_id!r} has finished")
        kind = self.scheduler.pause(request_id, retention, expected_wait_ms=expected_wait_ms)
        seq.paused = True
        seq.stream.finish()
        self._inbox.extend(self._collect([request_id]))
        return kind

    def resume(
        self,
        request_id: str,
        tool_output: str | Sequence[int],
        params: SamplingParams | Mapping[str, object] | None = None,
    ) -> None:
        """The tool answered: append its output to the conversation and generate the next
        turn (the prompt of the turn is every token so far plus the tool's).

        ``tool_output`` is text (encoded with the engine tokenizer, no special tokens) or
        token ids. ``params`` are the new turn's sampling params (``None``: the previous
        turn's; ``n`` must be 1); ``max_tokens`` counts this turn's outputs. The turn's
        seed is ``params.seed`` mixed with the turn number when a seed is given (turns
        reproducible, yet not the same random stream), else a fresh engine draw.

        Outputs of the new turn start fresh (``token_ids`` / ``text`` are this turn's,
        ``turn`` is one more than before; metrics count from the resume: arrival is the
        resume time, token times are this turn's, ``admitted_ms`` is None). Bad input
        raises a typed error (unknown id: :class:`UnknownRequest`; not paused:
        :class:`InvalidArgument`; empty or out-of-vocabulary tool output or a turn that
        would reach ``max_model_len``: :class:`InvalidPrompt`; a turn whose KV could never
        fit the device pool: :class:`ExceedsCapacity`; bad params:
        :class:`InvalidSamplingParams`) and changes nothing.
        """
        group = self._groups.get(request_id)
        if group is None:
            raise UnknownRequest(request_id, "resume")
        req = self.scheduler.paused.get(request_id)
        if req is None:
            raise InvalidArgument(f"resume: request {request_id!r} is not paused for a tool")
        sp = group.params if params is None else _sampling_params(params)
        if sp.n != 1:
            raise InvalidSamplingParams(
                f"resume: a turn samples one sequence (n=1), got n={sp.n}", field="n"
            )
        tool = self._prompt_ids(tool_output, what="tool output", add_special_tokens=False)
        self._check_room(req.num_tokens + len(tool), f"resume: request {request_id!r} would hold")
        stop = self._stop_params(sp)
        turn = group.turn + 1
        seed = mix64(sp.seed, turn) if sp.seed is not None else self._rng.randrange(1 << 62)
        arrival = self.now_ms()
        times_from = len(req.token_times_ms)
        self.scheduler.resume(request_id, tool, stop)  # may raise: nothing changed yet
        self.executor.register(request_id, sample_spec(sp, seed))
        prompt = tuple(req.prompt_token_ids)  # the conversation plus the tool's tokens
        seq = self._new_seq(request_id, request_id, 0, req, sp, prompt)
        seq.turn = turn
        seq.times_from = times_from
        seq.turn_arrival_ms = arrival
        group.params, group.stop, group.seed = sp, stop, seed
        group.prompt_token_ids = prompt
        group.seqs = [seq]
        group.turn = turn

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
        outputs, self._inbox = self._inbox, []
        outputs.extend(fresh)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One core step (ref/core/engine_core.py), then what it means for the sequences,
        in this order (module doc): new tokens, forks of ``n > 1`` samples, requests the
        scheduler finished, failed samples, stop strings. Returns the outputs of every
        sequence the step touched."""
        if self.proposer is not None:
            self._propose(self.proposer)
        record = self.core.step(self.now_ms())
        self._count(record)
        outcome = record.outcome
        # A list, not the outcome's id-keyed mapping: it is walked twice, never looked up.
        new_tokens = list(outcome.last_tokens())
        # The sampler could not sample their row (module doc, "Faults").
        failed = [sid for sid, _ in new_tokens if sample_failed(_last_logprob(record, sid))]
        touched = self._append_tokens(new_tokens, record)
        for parent_id, samples in record.fork_samples.items():
            touched.extend(
                self._fork(parent_id, samples, parent_id in outcome.finished, parent_id in failed)
            )
        self._close_finished(outcome.finished, failed, touched)
        self._end_failed(failed, record.end_ms)
        self._end_at_stop_strings(touched, record.end_ms)
        return self._collect(touched)

    def _count(self, record: StepRecord) -> None:
        self.steps.append(record)
        self.num_preemptions += len(record.outcome.preempted)
        self.num_prefix_hit_tokens += sum(record.plan.num_new_cached_tokens)

    def _propose(self, proposer: Proposer) -> None:
        """Drafts for every decoding request's next step (docs/SPECULATIVE.md), no more
        than it may still emit less one; the proposer's distributions, when it has
        them, go to the executor for the verification."""
        sched, executor = self.scheduler, self.executor
        for r in sched.running:
            if r.status is not RequestStatus.DECODING:
                continue
            rid = r.request_id
            limit = r.stop.max_tokens - r.num_output_tokens - 1
            draft = proposer.draft(r.token_ids, executor.spec(rid), r.num_output_tokens, limit)
            if draft.probs is not None:
                executor.draft_probs[rid] = draft.probs
            sched.propose(rid, draft.tokens)

    def _append_tokens(
        self, new_tokens: Sequence[tuple[str, int]], record: StepRecord
    ) -> list[str]:
        """Each committed token to its sequence (all of a verification's, up to a stop
        string); the ids, in commit order."""
        touched: list[str] = []
        verified = record.outcome.verified
        for sid, token in new_tokens:
            seq = self._seqs[sid]
            v = verified.get(sid)
            if v is None:
                emitted = [(token, record.logprobs.get(sid))]
            else:
                seq.num_draft_tokens += v.num_drafts
                seq.num_accepted_tokens += v.num_accepted
                self.num_draft_tokens += v.num_drafts
                self.num_accepted_tokens += v.num_accepted
                self.num_verifications += 1
                emitted = _verified_tokens(record, sid, v)
            for t, logprob in emitted:
                # A failed sample's token is a placeholder, not the model's: never shown.
                if not sample_failed(logprob) and seq.pending_stop is None:
                    self._append(seq, t, logprob)
            touched.append(sid)
        return touched

    def _close_finished(
        self, finished: Sequence[str], failed: Sequence[str], touched: list[str]
    ) -> None:
        """Sequences the scheduler finished in the step (max_tokens, a stop id, a limit),
        with its reason; a failed sample ends with ``error`` instead (:meth:`_end_failed`).
        Adds to ``touched`` what now has a final output."""
        for sid in finished:
            seq = self._seqs[sid]
            if seq.finished or sid in failed:
                continue
            req = seq.request
            assert req is not None and req.finish_reason is not None
            if seq.index == 0 and not seq.token_ids:  # ended before its first token
                group = self._groups[seq.request_id]
                touched.extend(self._close_unforked(group, req.finish_reason.value))
            if seq.pending_stop is not None:  # a stop string on the same token wins
                self._finish(seq, FinishReason.STOP.value, seq.pending_stop)
                continue
            stopped_by_token = req.finish_reason is FinishReason.STOP and seq.token_ids
            self._finish(
                seq, req.finish_reason.value, seq.token_ids[-1] if stopped_by_token else None
            )
            if sid not in touched:
                touched.append(sid)

    def _end_failed(self, failed: Sequence[str], now_ms: float) -> None:
        """End each failed sample with ``error``, at the step boundary like a stop string:
        the step committed for everyone (the placeholder token included) and only this
        request ends. Its placeholder may already have ended it in commit (max_tokens, a
        stop id): then only the reason is corrected; the token is still not shown."""
        for sid in failed:
            if sid in self.scheduler.requests:
                self.scheduler.finish(sid, FinishReason.ERROR, now_ms)
            self._finish(self._seqs[sid], FinishReason.ERROR.value, None)

    def _end_at_stop_strings(self, touched: Sequence[str], now_ms: float) -> None:
        """End the sequences whose text reached a stop string (the scheduler does not
        know about stop strings: the request is finished from here)."""
        for sid in touched:
            seq = self._seqs[sid]
            if seq.pending_stop is not None and not seq.finished:
                if sid in self.scheduler.requests:
                    self.scheduler.finish(sid, FinishReason.STOP, now_ms)
                self._finish(seq, FinishReason.STOP.value, seq.pending_stop)

    # ------------------------------------------------------------------ driving
    def _drive(
        self,
        wants: Callable[[RequestOutput], bool],
        done: Callable[[], bool],
        what: str,
        max_idle_steps: int = MAX_IDLE_STEPS,
    ) -> Iterator[RequestOutput]:
        """The one loop that steps the engine for a caller (:meth:`iter_outputs`,
        :meth:`stream`, :meth:`generate`): until ``done()``, yield the held outputs the
        caller ``wants`` or, when none is held, step once and yield the wanted outputs it
        produced. Every other output stays held for :meth:`step`, in order.

        ``max_idle_steps`` passes in a row without a single output (held or produced,
        wanted or not) raise :class:`EngineStalled`: requests are unfinished, yet nothing
        comes out of them.
        """
        idle = 0
        while not done():
            mine = self._take_held(wants)
            produced = bool(mine)
            if not mine and self.scheduler.has_unfinished:
                fresh = self._step()
                produced = bool(fresh)
                for o in fresh:
                    (mine if wants(o) else self._inbox).append(o)
            idle = 0 if produced else idle + 1
            if idle > max_idle_steps:
                raise EngineStalled(f"{what}: {max_idle_steps} steps in a row produced no output")
            yield from mine

    def _take_held(self, wants: Callable[[RequestOutput], bool]) -> list[RequestOutput]:
        """Remove the held outputs a caller wants from the inbox (the rest stay, in order)."""
        taken: list[RequestOutput] = []
        kept: list[RequestOutput] = []
        for o in self._inbox:
            (taken if wants(o) else kept).append(o)
        self._inbox = kept
        return taken

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
            if rid not in self._groups:
                return True
            # Paused for a tool: the stream ends with the turn, once its output is out.
            return rid in self.scheduler.paused and all(o.request_id != rid for o in self._inbox)

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
        ids = self._add_batch(_as_prompt_list(prompts), params)
        wanted = set(ids)
        prompts_of = {rid: self._groups[rid].prompt_token_ids for rid in ids}
        final: dict[str, dict[int, RequestOutput]] = {rid: {} for rid in ids}
        try:
            for o in self._drive(
                lambda o: o.request_id in wanted,
                lambda: not any(rid in self._groups for rid in ids),
                "generate",
            ):
                if o.finished:
                    final[o.request_id][o.index] = o
        except BaseException:
            self._drop(ids)
            raise
        return [
            GenerationResult(rid, prompts_of[rid], tuple(final[rid][i] for i in sorted(final[rid])))
            for rid in ids
        ]

    def _add_batch(
        self,
        batch: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[str]:
        """Add every prompt of a :meth:`generate` call, or none: a rejected one drops
        those already added (:meth:`_drop`) and the error is raised."""
        if params is None or isinstance(params, SamplingParams):
            plist: list[SamplingParams | None] = [params] * len(batch)
        else:
            plist = list(params)
            if len(plist) != len(batch):
                raise InvalidArgument(
                    f"generate: {len(batch)} prompts but {len(plist)} sampling params"
                )
        ids: list[str] = []
        try:
            for p, sp in zip(batch, plist, strict=True):
                ids.append(self.add_request(p, sp))
        except BaseException:
            self._drop(ids)
            raise
        return ids

    def _drop(self, ids: Sequence[str]) -> None:
        """Abort the requests ``ids`` that are still live and drop every output of theirs
        held for :meth:`step` (a :meth:`generate` call that fails takes its own
        requests with it, and only those)."""
        for rid in ids:
            if rid in self._groups:
                with contextlib.suppress(RefserveError):  # the first error is the one
                    self.abort(rid)
        gone = set(ids)
        self._inbox = [o for o in self._inbox if o.request_id not in gone]

    # ------------------------------------------------------------------ internals
    def _check_room(self, num_tokens: int, subject: str) -> None:
        """A prompt or resumed turn must leave room for an output token under
        ``max_model_len`` (:func:`refserve.core.request.check_room_for_output`); checked here,
        before anything is registered, to raise :class:`InvalidPrompt`."""
        check_room_for_output(
            num_tokens,
            self.max_model_len,
            subject=subject,
            limit=f"max_model_len is {self.max_model_len}",
            error=InvalidPrompt,
        )

    def _prompt_ids(
        self, prompt: Prompt, *, what: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidPrompt(f"{what} is an empty string")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            ids = list(cast("Sequence[int]", prompt))  # each element is checked below
        else:
            raise InvalidPrompt(
                f"{what} must be a str or a sequence of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidPrompt(f"{what} has no tokens")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidPrompt(
                    f"{what} token {i} is {t!r}; token ids must be ints in [0, {vocab})"
                )
        return ids

    def _new_id(self, request_id: str | None) -> str:
        if request_id is None:
            while True:
                rid = f"req-{self._next_id}"
                self._next_id += 1
                if rid not in self._groups and rid not in self._seqs:
                    return rid
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument(f"request_id must be a non-empty str, got {request_id!r}")
        if FORK_SEPARATOR in request_id:
            # Sample ids "<id>#<i>" are the engine's (module doc): "x#1" taken by a caller
            # would collide with sample 1 of "x" when it forks, after its step committed.
            raise InvalidArgument(
                f"request_id must not contain {FORK_SEPARATOR!r} (reserved for the ids of "
                f"samples 1..n-1, '<id>{FORK_SEPARATOR}<i>'), got {request_id!r}"
            )
        if (
            request_id in self._groups
            or request_id in self._seqs
            or request_id in self.scheduler.requests
        ):
            raise DuplicateRequest(request_id, "add_request")
        return request_id

    def _stop_params(self, sp: SamplingParams) -> StopParams:
        eos_ids = self.model_config.eos_token_ids
        tok_eos = self.tokenizer.eos_token_id
        if not eos_ids and tok_eos is not None:
            eos_ids = (tok_eos,)
        extra = () if sp.ignore_eos else eos_ids[1:]
        return StopParams(
            max_tokens=sp.max_tokens,
            stop_token_ids=tuple(dict.fromkeys((*sp.stop_token_ids, *extra))),
            eos_token_id=eos_ids[0] if eos_ids else None,
            ignore_eos=sp.ignore_eos,
        )

    def _new_seq(
        self,
        seq_id: str,
        request_id: str,
        index: int,
        req: Request | None,
        sp: SamplingParams,
        prompt_ids: Sequence[int],
    ) -> Sample:
        stream = TextStream(
            self.tokenizer.detokenizer(prompt_ids),
            sp.stop,
            include_stop_str_in_output=sp.include_stop_str_in_output,
        )
        seq = Sample(seq_id, request_id, index, req, stream, [] if sp.logprobs else None)
        self._seqs[seq_id] = seq
        return seq

    def _append(self, seq: Sample, token: int, logprob: float | None) -> None:
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(float("nan") if logprob is None else logprob)
        if seq.stream.add(token) and seq.pending_stop is None:
            seq.pending_stop = seq.stream.stopped_by

    def _fork(
        self,
        parent_id: str,
        samples: Sequence[DrawnToken],
        parent_finished: bool,
        parent_failed: bool = False,
    ) -> list[str]:
        """Samples 1..n-1 of ``parent_id`` after its first token (see the module doc).

        A sample the sampler could not draw ends with ``error`` and no token. When the
        parent's own sample failed, so do all of them: they come from the same row of
        logits, and the parent (about to end with ``error``) has nothing to fork from.
        """
        parent = self._seqs[parent_id]
        group = self._groups[parent.request_id]
        group.forked = True
        self.executor.forked(parent_id)
        preq = parent.request
        assert preq is not None
        assert len(samples) == len(group.child_ids), "one first token per sample 1..n-1"
        out: list[str] = []
        for i, drawn in enumerate(samples, start=1):
            if parent_failed or sample_failed(drawn.logprob):
                out.append(self._tokenless_sample(group, i, preq, FinishReason.ERROR.value))
            else:
                out.append(self._forked_sample(group, i, preq, drawn, parent_finished))
        if not parent_finished and not parent_failed:
            preq.stop = group.stop  # the real stop conditions, from the second token on
            if preq.request_id in self.scheduler.batch:
                # The bulk decode path reads the stop ids off the request's batch row.
                self.scheduler.batch.reload(preq, self.scheduler.pool)
            token = parent.token_ids[-1]
            if group.stop.is_stop(token) and parent.pending_stop is None:
                parent.pending_stop = token
        return out

    def _forked_sample(
        self,
        group: SampleGroup,
        index: int,
        parent: Request,
        drawn: DrawnToken,
        parent_finished: bool,
    ) -> str:
        """Sample ``index`` (>= 1) with its first token ``drawn``: a live request forked off
        ``parent`` in the scheduler, or, when the parent finished or the token stops it,
        a sequence finished on that token. Returns its id for :meth:`_collect`."""
        cid = group.child_ids[index - 1]
        is_stop = group.stop.is_stop(drawn.token)
        live = not parent_finished and not is_stop
        child_req = None
        if live:
            child_req = self.scheduler.fork(parent.request_id, cid, drawn.token, group.stop)
            self.executor.register(cid, sample_spec(group.params, derive_seed(group.seed, index)))
            self.num_forks += 1
        seq = self._new_seq(
            cid, group.request_id, index, child_req, group.params, group.prompt_token_ids
        )
        seq.metrics_from = None if live else parent
        group.seqs.append(seq)
        self._append(seq, drawn.token, drawn.logprob)
        if child_req is not None and child_req.finish_reason is not None:
            self._finish(seq, child_req.finish_reason.value, None)  # could never fit
        elif not live:
            reason = FinishReason.STOP if is_stop else FinishReason.LENGTH
            self._finish(seq, reason.value, drawn.token if is_stop else None)
        return cid

    def _close_unforked(self, group: SampleGroup, reason: str) -> list[str]:
        """Final outputs for samples 1..n-1 of a request that ended before its first token
        (so before they were forked): each ends like sample 0, with no tokens."""
        if group.forked or len(group.seqs) > 1 or not group.child_ids:
            return []  # forked already (forks come with the first token), or n == 1
        group.forked = True
        parent = group.seqs[0]
        preq = parent.request
        assert preq is not None
        self.executor.forked(parent.seq_id)  # their specs will never be drawn
        return [
            self._tokenless_sample(group, i, preq, reason)
            for i in range(1, len(group.child_ids) + 1)
        ]

    def _tokenless_sample(
        self, group: SampleGroup, index: int, parent: Request, reason: str
    ) -> str:
        """Sample ``index`` (>= 1), never forked, finished with ``reason`` and no tokens;
        its metrics are the parent request's. Returns its id for :meth:`_collect`."""
        cid = group.child_ids[index - 1]
        seq = self._new_seq(
            cid, group.request_id, index, None, group.params, group.prompt_token_ids
        )
        seq.metrics_from = parent
        group.seqs.append(seq)
        self._finish(seq, reason, None)
        return cid

    def _finish(self, seq: Sample, reason: str, stop_reason: str | int | None) -> None:
        seq.finished = True
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.stream.finish()

    def _collect(self, seq_ids: Sequence[str]) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        for sid in dict.fromkeys(seq_ids):
            seq = self._seqs.get(sid)
            if seq is None:
                continue
            new_ids = tuple(seq.token_ids[seq.delivered_tokens :])
            new_lp = None if seq.logprobs is None else tuple(seq.logprobs[seq.delivered_tokens :])
            seq.delivered_tokens = len(seq.token_ids)
            ended = seq.finished or seq.paused  # the turn's text is complete
            outs.append(
                RequestOutput(
                    request_id=seq.request_id,
                    index=seq.index,
                    new_text=seq.stream.take(final=ended),
                    new_token_ids=new_ids,
                    new_logprobs=new_lp,
                    text=seq.stream.text if ended else seq.stream.emitted_text,
                    token_ids=tuple(seq.token_ids),
                    logprobs=None if seq.logprobs is None else tuple(seq.logprobs),
                    finished=seq.finished,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    metrics=self._metrics(seq),
                    turn=seq.turn,
                )
            )
            if seq.finished:
                self._retire(seq)
        return outs

    def _metrics(self, seq: Sample) -> RequestMetrics:
        req = seq.request if seq.request is not None else seq.metrics_from
        assert req is not None
        group = self._groups.get(seq.request_id)
        # A resumed turn's figures are the turn's: its token times, from its resume.
        first = seq.times_from
        times = tuple(req.token_times_ms[first : first + len(seq.token_ids)])
        return RequestMetrics(
            request_id=seq.seq_id,
            arrival_ms=req.arrival_ms if seq.turn_arrival_ms is None else seq.turn_arrival_ms,
            admitted_ms=req.admitted_ms if seq.turn == 0 else None,
            token_times_ms=times,
            finished_ms=req.finished_ms if seq.finished else None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(seq.token_ids),
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
            migrations=tuple(group.migrations) if group is not None else (),
        )

    def _retire(self, seq: Sample) -> None:
        del self._seqs[seq.seq_id]
        self.executor.unregister(seq.seq_id)
        group = self._groups.get(seq.request_id)
        # Forks happen in the step that samples the first token, before outputs are
        # collected, so a group whose current samples are all finished is done.
        if group is not None and all(s.finished for s in group.seqs):
            del self._groups[seq.request_id]


def _verified_tokens(record: StepRecord, sid: str, v: Outcome) -> list[tuple[int, float | None]]:
    """The tokens a verification gave ``sid``, each with its logprob: the accepted
    drafts, then the target's token, as the commit kept them (cut at a stop,
    docs/SPECULATIVE.md). The executor's logprobs cover the whole verification, so they
    are matched by position: after a cut, ``record.logprobs`` (the target token's) is
    not the last kept token's."""
    per_token = record.verified_logprobs.get(sid)
    target = record.logprobs.get(sid) if len(v.tokens) == v.num_accepted + 1 else None
    return [
        (t, per_token[j] if per_token is not None else (target if j == v.num_accepted else None))
        for j, t in enumerate(v.tokens)
    ]


def _last_logprob(record: StepRecord, sid: str) -> float | None:
    """The logprob of the last token a step gave ``sid`` (NaN: its row failed)."""
    v = record.outcome.verified.get(sid)
    return record.logprobs.get(sid) if v is None else _verified_tokens(record, sid, v)[-1][1]


def _sampling_params(params: SamplingParams | Mapping[str, object] | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        # Built again, so validated again: a frozen dataclass can still be altered with
        # object.__setattr__, and a value that cannot be sampled must not reach a step.
        return replace(params)
    if isinstance(params, Mapping):
        return SamplingParams.from_dict(params)
    raise InvalidSamplingParams(
        f"params must be SamplingParams or a mapping, got {type(params).__name__}"
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
