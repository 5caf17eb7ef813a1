"""``refserve generate --migrate-every K``: one request moved between two engines every
``K`` steps, each move reported, and its output checked against an unmigrated run
(docs/MIGRATION.md).

Engine A takes the scheduler options as given; engine B is the same but for its block
size (``--peer-block-size``, by default twice A's), so a move re-blocks the K/V instead of
copying block for block. The request starts on A; after every ``K`` of its steps it moves
to the other engine with :func:`refserve.engine.migration.migrate`, mid-prefill included, its
K/V sent (inline or in chunks of ``--migration-chunk-blocks`` source blocks) or left to be
recomputed, as ``--migration-kv`` says. A third engine, configured as A, runs the same
prompt and parameters without moving it; the command fails (exit 1) unless every sample's
tokens, text and finish reason are the same.

A move is skipped while the request holds no more K/V than at its previous move: a
recomputed request catching up would otherwise be moved again before it got anywhere
(with ``K`` steps of budget below its context, for ever). Each move then extends the
furthest point the request has reached, so the run ends.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from refserve.cli.args import MAX_BLOCK_SIZE, MAX_BLOCKS, MAX_STEPS, int_at_most
from refserve.errors import InvalidArgument

if TYPE_CHECKING:  # the engine is imported when the command runs, not at startup
    from refserve.core.config import SchedulerConfig
    from refserve.core.migration_cost import KVMode
    from refserve.core.request import Request
    from refserve.engine.llm_engine import GenerationResult, LLMEngine, RequestOutput
    from refserve.engine.migration import MigrationReport
    from refserve.model.sampler import SamplingParams

#: The token budget of both engines when ``--max-num-batched-tokens`` is not given: small
#: enough that a prompt's prefill spans several steps, so the moves cut it.
MIGRATION_BUDGET = 8
KV_MODES = ("transfer", "recompute", "auto")


def add_migration_args(p: argparse.ArgumentParser) -> None:
    """The options :func:`plan_from_args` reads."""
    p.add_argument(
        "--migrate-every",
        type=int_at_most(MAX_STEPS, lo=1),
        metavar="K",
        help="run the prompt on two engines, A and B, moving the request to the other one "
        "every K steps (mid-prefill included), report each move, and check the output "
        "equals an unmigrated run (exit 1 if not). Unless --max-num-batched-tokens is "
        f"given, both engines take {MIGRATION_BUDGET} tokens a step",
    )
    p.add_argument(
        "--migration-kv",
        choices=KV_MODES,
        help="with --migrate-every: send the K/V with the request (transfer), let the "
        "destination prefill it again (recompute), or let the cost rule choose per move "
        "(auto, the default)",
    )
    p.add_argument(
        "--migration-chunk-blocks",
        type=int_at_most(MAX_BLOCKS, lo=1),
        metavar="N",
        help="with --migrate-every: stream transferred K/V in chunks of N source blocks "
        "(default: inline, in the request's ticket)",
    )
    p.add_argument(
        "--peer-block-size",
        type=int_at_most(MAX_BLOCK_SIZE, lo=1),
        metavar="TOKENS",
        help="with --migrate-every: engine B's tokens per KV block (default: twice "
        "--block-size, or half where twice is above the limit)",
    )


@dataclass(frozen=True)
class MigrationPlan:
    """What ``--migrate-every`` and its options ask for."""

    every: int
    kv: KVMode
    chunk_blocks: int | None
    peer_block_size: int


def plan_from_args(args: argparse.Namespace) -> MigrationPlan | None:
    """The plan, None without ``--migrate-every``; every check runs before a model is
    built. Raises :class:`InvalidArgument` naming the option."""
    from refserve.core.migration_cost import KVMode

    if args.migrate_every is None:
        for option, value in (
            ("--migration-kv", args.migration_kv),
            ("--migration-chunk-blocks", args.migration_chunk_blocks),
            ("--peer-block-size", args.peer_block_size),
        ):
            if value is not None:
                raise InvalidArgument(f"{option} needs --migrate-every K")
        return None
    kv = KVMode(args.migration_kv or KVMode.AUTO)
    if args.migration_chunk_blocks is not None and kv is KVMode.RECOMPUTE:
        raise InvalidArgument(
            "--migration-chunk-blocks streams K/V that is sent; with --migration-kv "
            "recompute none is"
        )
    if args.speculative is not None and args.temperature > 0 and kv is not KVMode.TRANSFER:
        # A recomputed request samples its next token in a plain step, where the unmoved
        # run verified drafts: same distribution (docs/SPECULATIVE.md), other tokens.
        raise InvalidArgument(
            f"--migration-kv {kv.value} with --speculative and --temperature > 0: a move "
            "that recomputes the K/V keeps the output's distribution, not its tokens, so "
            "the check against the unmigrated run cannot hold; use --migration-kv transfer"
        )
    peer = args.peer_block_size
    if peer is None:
        bs = args.block_size
        peer = 2 * bs if 2 * bs <= MAX_BLOCK_SIZE else bs // 2
    return MigrationPlan(args.migrate_every, kv, args.migration_chunk_blocks, peer)


# ---------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class CliMigration:
    """One move of the request, as reported."""

    step: int
    source: str
    dest: str
    state: str  # what the request was doing on the source
    report: MigrationReport
    hit_tokens: int  # of its K/V, already in the destination's prefix cache
    inline: bool  # sent in the ticket, else streamed in chunks

    @property
    def kv_mode(self) -> str:
        return self.report.decision.mode.value

    @property
    def moved_tokens(self) -> int:
        """Tokens whose K/V the destination wrote from what was sent."""
        return self.report.decision.moved_tokens

    def line(self, asked: KVMode) -> str:
        """``[step   4] A -> B  decoding, 3 tokens out | transfer | KV 17 tokens: 16
        cached on B, 1 copied | 26,112 B inline`` (the rule's two costs after ``auto``)."""
        d = self.report.decision
        how = self.kv_mode
        if asked.value == "auto":
            how += f" (auto: {d.transfer_ms:.2g} ms to send < {d.recompute_ms:.2g} to recompute)"
            if self.kv_mode == "recompute":
                how = how.replace(" < ", " > ")
        kv = f"KV {d.kv_tokens} tokens: {self.hit_tokens} cached on {self.dest}"
        if self.kv_mode == "recompute":
            kv += f", {d.kv_tokens - self.hit_tokens} to recompute"
            sent = "0 B sent"
        else:
            kv += f", {self.moved_tokens} copied"
            chunks = self.report.num_chunks
            way = "inline" if self.inline else f"in {chunks} chunk{'s' * (chunks != 1)}"
            sent = f"{self.report.kv_bytes:,} B {way}"
        head = f"[step {self.step:3d}] {self.source} -> {self.dest}  {self.state}"
        return f"{head} | {how} | {kv} | {sent}"

    def to_json(self) -> dict[str, object]:
        d = self.report.decision
        return {
            "step": self.step,
            "from": self.source,
            "to": self.dest,
            "state": self.state,
            "kv_mode": self.kv_mode,
            "kv_tokens": d.kv_tokens,
            "hit_tokens": self.hit_tokens,
            "moved_tokens": self.moved_tokens,
            "bytes": self.report.kv_bytes,
            "chunks": self.report.num_chunks,
            "transfer_ms": d.transfer_ms,
            "recompute_ms": d.recompute_ms,
        }


@dataclass(frozen=True)
class MigratedRun:
    """The migrated run, the unmigrated one, and the moves between them."""

    result: GenerationResult
    baseline: GenerationResult
    moves: tuple[CliMigration, ...]
    steps: int
    engines: dict[str, SchedulerConfig]

    @property
    def mismatch(self) -> str | None:
        """How the migrated output differs from the unmigrated one; None if it does not."""
        return first_difference(self.result.outputs, self.baseline.outputs)


def first_difference(got: Sequence[RequestOutput], want: Sequence[RequestOutput]) -> str | None:
    """The first difference between two runs' final outputs, in words; None if none."""
    if len(got) != len(want):
        return f"{len(got)} samples finished, the unmigrated run has {len(want)}"
    for g, w in zip(got, want, strict=True):
        tag = f"sample {g.index}"
        if g.token_ids != w.token_ids:
            i = next(
                (
                    i
                    for i, (x, y) in enumerate(zip(g.token_ids, w.token_ids, strict=False))
                    if x != y
                ),
                min(len(g.token_ids), len(w.token_ids)),
            )
            here = g.token_ids[i] if i < len(g.token_ids) else "nothing"
            there = w.token_ids[i] if i < len(w.token_ids) else "nothing"
            return f"{tag}: token {i} is {here}, the unmigrated run has {there}"
        for field in ("text", "finish_reason", "stop_reason"):
            if getattr(g, field) != getattr(w, field):
                return (
                    f"{tag}: {field} is {getattr(g, field)!r}, the unmigrated run has "
                    f"{getattr(w, field)!r}"
                )
    return None


def run_migrated(
    make_engine: Callable[[SchedulerConfig], LLMEngine],
    config: SchedulerConfig,
    plan: MigrationPlan,
    prompt: str | list[int],
    params: SamplingParams,
    say: Callable[[str], None],
) -> MigratedRun:
    """Run ``prompt`` unmigrated on an engine built with ``config``, then on A (that
    config) and B (``plan.peer_block_size``) moving it every ``plan.every`` steps (module
    doc); ``say`` gets one line per move or skipped move."""
    from refserve.engine.llm_engine import MAX_IDLE_STEPS, EngineStalled, GenerationResult

    configs = {"A": config, "B": replace(config, block_size=plan.peer_block_size)}
    (baseline,) = make_engine(config).generate([prompt], params)
    engines = {name: make_engine(cfg) for name, cfg in configs.items()}
    _require_room(engines, len(baseline.prompt_token_ids) + params.max_tokens)
    rid = engines["A"].add_request(prompt, params)
    here, there = "A", "B"
    final: dict[int, RequestOutput] = {}
    moves: list[CliMigration] = []
    step = idle = 0
    while engines[here].has_unfinished:
        outputs = engines[here].step()
        step += 1
        final.update((o.index, o) for o in outputs if o.finished)
        idle = 0 if outputs else idle + 1
        if idle > MAX_IDLE_STEPS:
            raise EngineStalled(f"--migrate-every: {MAX_IDLE_STEPS} steps without output")
        if step % plan.every or not engines[here].scheduler.requests:
            continue
        # The most K/V the request held at a move: a move must extend it (module doc).
        furthest = max((m.report.decision.kv_tokens for m in moves), default=-1)
        move = _move(step, (here, engines[here]), (there, engines[there]), rid, plan, furthest, say)
        if move is not None:
            moves.append(move)
            say(move.line(plan.kv))
            here, there = there, here
    result = GenerationResult(
        rid, baseline.prompt_token_ids, tuple(final[i] for i in sorted(final))
    )
    return MigratedRun(result, baseline, tuple(moves), step, configs)


def _move(
    step: int,
    source: tuple[str, LLMEngine],
    dest: tuple[str, LLMEngine],
    rid: str,
    plan: MigrationPlan,
    furthest: int,
    say: Callable[[str], None],
) -> CliMigration | None:
    """Move ``rid`` from ``source`` to ``dest`` (each named), or say why it stays."""
    from refserve.core.migration_cost import KVMode
    from refserve.core.transit import MigrationError, MigrationRefused
    from refserve.engine.migration import migrate

    (here, src), (there, dst) = source, dest
    samples = list(src.scheduler.requests.values())
    kv = max(r.num_computed_tokens for r in samples)
    if kv <= furthest:
        say(
            f"[step {step:3d}] stays on {here}: {kv} tokens of KV, no more than the "
            f"{furthest} it had at its last move (it is still recomputing its K/V)"
        )
        return None
    state = describe(samples)
    hit = dst.prefix_hit_tokens(samples[0].token_ids[:kv], samples[0])
    try:
        report = migrate(src, dst, rid, kv=plan.kv, chunk_blocks=plan.chunk_blocks)
    except MigrationError as e:
        # No room there now (refused), or ever for its length (a plain MigrationError):
        # it stays, as it was. A bad ticket or an abort is a bug here: raised.
        if not isinstance(e, MigrationRefused) and type(e) is not MigrationError:
            raise
        say(f"[step {step:3d}] stays on {here}: {there} refused it ({e})")
        return None
    if report.decision.mode is KVMode.TRANSFER:
        hit = report.decision.hit_tokens  # what the destination's stage found
    return CliMigration(step, here, there, state, report, hit, plan.chunk_blocks is None)


def _require_room(engines: dict[str, LLMEngine], num_tokens: int) -> None:
    """Both pools hold the request at its longest: on a pool too small for it, a run
    ends at capacity where a run on the other engine goes on, and the two outputs
    differ for a reason that has nothing to do with the moves."""
    from refserve.core.capacity import never_fits

    for name, engine in engines.items():
        cfg = engine.scheduler.config
        longest = min(num_tokens, cfg.max_len)
        if never_fits(cfg, longest):
            raise InvalidArgument(
                f"--num-blocks {cfg.num_blocks}: engine {name}'s pool holds "
                f"{cfg.num_blocks * cfg.block_size} tokens of KV ({cfg.block_size}-token "
                f"blocks), the request may grow to {longest}; a run that ends at capacity "
                "on one engine and not on the other cannot be compared"
            )


def describe(samples: Sequence[Request]) -> str:
    """What a request was doing when it moved, in a few words."""
    from refserve.spec.snapshot import RequestStatus as S

    r = samples[0]
    if r.status is S.PREFILLING and r.num_output_tokens == 0:
        what = f"mid-prefill, {r.num_computed_tokens}/{r.num_prompt_tokens} prompt tokens"
    elif r.status is S.PREFILLING:
        what = f"recomputing, {r.num_computed_tokens}/{r.num_tokens} tokens"
    elif r.status is S.DECODING:
        n = r.num_output_tokens
        what = f"decoding, {n} token{'s' * (n != 1)} out"
    else:
        what = {S.WAITING: "waiting, no KV yet", S.PREEMPTED: "preempted, no KV"}.get(
            r.status, str(r.status)
        )
    return what if len(samples) == 1 else f"{what} ({len(samples)} samples)"
