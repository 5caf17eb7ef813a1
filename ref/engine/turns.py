"""Agent turns (tool waits): a decoding request pauses for a tool call, its KV kept on
the device, moved to the host or dropped (``KVRetention``), and resumes with the tool's
output appended to the conversation, generating the next turn from the retained KV (or
recomputing it). Outputs are per turn (ref/engine/llm_engine.py, module doc)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from refserve.core.scheduler import Scheduler
from refserve.core.swap import KVRetention
from refserve.engine.intake import Intake, sampling_params
from refserve.engine.outputs import Outputs
from refserve.engine.samples import SampleBook, sample_spec
from refserve.errors import InvalidArgument, UnknownRequest
from refserve.model.executor import ModelExecutor
from refserve.model.sampler import InvalidSamplingParams, SamplingParams, mix64


class AgentTurns:
    """Pauses and resumes the engine's requests for tools (module doc)."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: ModelExecutor,
        books: SampleBook,
        outputs: Outputs,
        intake: Intake,
        clock: Callable[[], float],
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.books = books
        self.outputs = outputs
        self.intake = intake
        self.clock = clock

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
        no new tokens carries that text, delivered by the engine's next ``step``. A paused
        request then produces nothing until ``resume``; it is not finished
        (``has_unfinished`` stays true) but needs no steps (``has_runnable`` ignores it,
        and ``iter_outputs`` returns when only paused requests are left).
        The engine's ``abort`` ends it like any live request. With ``host`` the KV moves in the
        next ``step`` (the executor copies it even if that step schedules nothing).

        Only ``n == 1`` requests pause, and only while decoding (a request just preempted
        waits to be re-admitted first). Bad input raises a typed error (unknown id:
        :class:`UnknownRequest`; ``n > 1``, not decoding, already paused, ``host`` with no
        host pool, a bad retention: :class:`InvalidArgument`) and changes nothing.
        """
        group = self.books.group(request_id)
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
        self.outputs.hold(self.outputs.collect([request_id]))
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
        group = self.books.group(request_id)
        if group is None:
            raise UnknownRequest(request_id, "resume")
        req = self.scheduler.paused.get(request_id)
        if req is None:
            raise InvalidArgument(f"resume: request {request_id!r} is not paused for a tool")
        sp = group.params if params is None else sampling_params(params)
        if sp.n != 1:
            raise InvalidSamplingParams(
                f"resume: a turn samples one sequence (n=1), got n={sp.n}", field="n"
            )
        tool = self.intake.prompt_ids(tool_output, what="tool output", add_special_tokens=False)
        self.intake.check_room(
            req.num_tokens + len(tool), f"resume: request {request_id!r} would hold"
        )
        stop = self.intake.stop_params(sp)
        turn = group.turn + 1
        seed = self.intake.seed(None if sp.seed is None else mix64(sp.seed, turn))
        arrival = self.clock()
        times_from = len(req.token_times_ms)
        self.scheduler.resume(request_id, tool, stop)  # may raise: nothing changed yet
        self.executor.register(request_id, sample_spec(sp, seed))
        prompt = tuple(req.prompt_token_ids)  # the conversation plus the tool's tokens
        seq = self.books.new_sample(request_id, request_id, 0, req, sp, prompt)
        seq.turn = turn
        seq.times_from = times_from
        seq.turn_arrival_ms = arrival
        group.params, group.stop, group.seed = sp, stop, seed
        group.prompt_token_ids = prompt
        group.seqs = [seq]
        group.turn = turn
