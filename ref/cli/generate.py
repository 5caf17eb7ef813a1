"""``refserve generate``: one prompt through the real engine, tokens and text printed.

Wired into ``ref/cli/main.py`` (``add_generate_parser``); ``python -m refserve.cli.generate ...``
runs it standalone under the same error surface (:func:`refserve.cli.args.run_cli`). Everything is
checked before a model is built: the device exists, the attention backend can run there,
the prompt and stop strings are text that can be encoded (a lone surrogate, which is what
Python makes of argv bytes that are not UTF-8, cannot), ``--prompt-ids`` are ints.

The scheduler's options are ``simulate``'s and ``serve``'s (:mod:`refserve.cli.config_args`);
``--migrate-every K`` moves the request between two engines as it runs and checks the
output against an unmigrated run (:mod:`refserve.cli.migrate`, docs/MIGRATION.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from refserve.cli.args import (
    EXIT_FAILED,
    MAX_TOKENS,
    add_command,
    add_device_args,
    add_speculative_args,
    check_device_args,
    int_at_most,
    proposer_from_args,
)
from refserve.cli.config_args import add_config_args, config_from_args
from refserve.cli.migrate import MIGRATION_BUDGET, add_migration_args, plan_from_args
from refserve.errors import InvalidArgument

if TYPE_CHECKING:  # the engine is imported when a command runs, not at startup
    from refserve.cli.migrate import MigratedRun, MigrationPlan
    from refserve.core.config import SchedulerConfig
    from refserve.engine.llm_engine import GenerationResult, LLMEngine, SpeculationStats
    from refserve.model.sampler import SamplingParams

#: Forks of one prompt: each is a sequence object and a scheduler slot.
MAX_N = 1024


def add_generate_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to an ``add_subparsers()`` object."""
    p = add_command(
        sub,
        "generate",
        "generate from a prompt with the real model (embedded or a local checkpoint)",
    )
    _add_args(p)
    p.set_defaults(func=run_generate)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="tiny-trained",
        help="'tiny-trained' (embedded, trained; the default), 'tiny' (embedded, random "
        "weights) or a local HF checkpoint dir",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        metavar="N",
        help="most tokens to generate per sample (default %(default)s; at most the model's "
        "max_model_len)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default %(default)s)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="sample from the K most likely tokens only; 0 is all (default %(default)s)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample from the smallest set of tokens whose probability reaches P, in (0, 1] "
        "(default %(default)s: all)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the sampler, for a reproducible sampled output (default: none)",
    )
    p.add_argument(
        "--n",
        type=int_at_most(MAX_N),
        default=1,
        help=f"parallel samples, forks of one prompt (default %(default)s; at most {MAX_N})",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a sample when its text contains TEXT (repeatable)",
    )
    add_device_args(p)
    p.add_argument("--json", action="store_true", help="print ids, finish reason and metrics")
    add_speculative_args(p)
    add_config_args(p)
    # The engine's own pool (serve's too); the budget's default depends on --migrate-every.
    p.set_defaults(num_blocks=1024)
    for action in p._actions:
        if action.dest == "max_num_batched_tokens":
            action.default = None
            action.help = (
                "token budget of one step, prompt chunks and decodes together (default "
                f"2048; {MIGRATION_BUDGET} with --migrate-every; 1 to {MAX_TOKENS:,})"
            )
    add_migration_args(p)


def _text(value: str, option: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(
            f"{option}: not valid UTF-8 text (character {e.start} is a lone surrogate "
            f"{value[e.start]!r}; bytes that are not UTF-8 on the command line become one)"
        ) from None
    return value


def _prompt_ids(text: str) -> list[int]:
    items = text.split(",")
    if len(items) == 1 and not items[0].strip():
        return []  # the engine names an empty prompt itself
    ids: list[int] = []
    for i, item in enumerate(items):
        try:
            ids.append(int(item))
        except ValueError:
            shown = item if len(item) <= 30 else item[:27] + "..."
            raise InvalidArgument(
                f"--prompt-ids: item {i} is {shown!r}; expected comma-separated ints like 1,2,3"
            ) from None
    return ids


def run_generate(args: argparse.Namespace) -> int:
    check_device_args(args)
    plan = plan_from_args(args)
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 2048 if plan is None else MIGRATION_BUDGET
    config = config_from_args(args)
    prompt: str | list[int]
    if args.prompt_ids is not None:
        prompt = _prompt_ids(args.prompt_ids)
    else:
        prompt = _text(args.prompt, "--prompt")
    stop = tuple(_text(s, "--stop") for s in args.stop)

    from refserve.engine.llm_engine import LLMEngine
    from refserve.kernels.validation import KernelInputError
    from refserve.model.sampler import SamplingParams

    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=stop,
    )
    proposer = proposer_from_args(args)

    def make_engine(cfg: SchedulerConfig) -> LLMEngine:
        engine = LLMEngine(
            args.model,
            scheduler_config=cfg,
            attention_backend=args.attention_backend,
            device=args.device,
            proposer=proposer,
            check_invariants=args.check,
        )
        if args.max_tokens > engine.max_model_len:
            raise InvalidArgument(
                f"--max-tokens {args.max_tokens} is more than the model's max_model_len "
                f"({engine.max_model_len})"
            )
        return engine

    try:
        if plan is not None:
            return _run_migrated(args, plan, make_engine, config, prompt, params)
        engine = make_engine(config)
        (result,) = engine.generate([prompt], params)
    except KernelInputError as e:  # a kernel refusing its inputs: still one typed line
        raise InvalidArgument(f"--attention-backend {args.attention_backend}: {e}") from None
    if args.json:
        doc = _json_doc(args.model, result)
        if proposer is not None:
            doc["speculation"] = _speculation(engine.speculation)
        print(json.dumps(doc, indent=2))
        return 0
    _print_outputs(result)
    if proposer is not None:
        print(f"speculation: {engine.speculation}")
    return 0


def _json_doc(model: str, result: GenerationResult) -> dict[str, object]:
    return {
        "model": model,
        "prompt_token_ids": list(result.prompt_token_ids),
        "outputs": [
            {
                "index": o.index,
                "token_ids": list(o.token_ids),
                "text": o.text,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
                "metrics": {
                    "ttft_ms": o.metrics.ttft_ms,
                    "itl_ms": list(o.metrics.itl_ms),
                    "e2e_ms": o.metrics.e2e_ms,
                    "num_prompt_tokens": o.metrics.num_prompt_tokens,
                    "num_output_tokens": o.metrics.num_output_tokens,
                    "num_cached_tokens": o.metrics.num_cached_tokens,
                    "num_preemptions": o.metrics.num_preemptions,
                    "num_draft_tokens": o.metrics.num_draft_tokens,
                    "num_accepted_tokens": o.metrics.num_accepted_tokens,
                },
            }
            for o in result.outputs
        ],
    }


def _print_outputs(result: GenerationResult) -> None:
    for o in result.outputs:
        tag = f"[{o.index}] " if len(result.outputs) > 1 else ""
        print(f"{tag}tokens: {' '.join(map(str, o.token_ids))}")
        print(f"{tag}text:   {o.text!r}")
        print(f"{tag}finish: {o.finish_reason}")


def _run_migrated(
    args: argparse.Namespace,
    plan: MigrationPlan,
    make_engine: Callable[[SchedulerConfig], LLMEngine],
    config: SchedulerConfig,
    prompt: str | list[int],
    params: SamplingParams,
) -> int:
    """``--migrate-every``: the moves as they happen, the output, then the check against
    the unmigrated run (exit 1 when it differs)."""
    from refserve.cli.migrate import run_migrated

    if not args.json:
        print(
            f"engines: A ({config.block_size}-token blocks), B ({plan.peer_block_size}-token "
            f"blocks), {config.num_blocks} blocks and {config.max_num_batched_tokens} tokens "
            f"a step each; the request moves every {plan.every} steps, its KV by "
            f"{plan.kv.value}"
            + (f" in chunks of {plan.chunk_blocks} blocks" if plan.chunk_blocks else "")
        )
    run = run_migrated(
        make_engine, config, plan, prompt, params, say=(lambda line: None) if args.json else print
    )
    mismatch = run.mismatch
    if args.json:
        doc = _json_doc(args.model, run.result)
        doc["migration"] = _migration_json(run, plan, mismatch)
        print(json.dumps(doc, indent=2))
    else:
        _print_outputs(run.result)
        print(_moves_summary(run))
        if mismatch is None:
            print(
                "identical to the unmigrated run: the same tokens, text and finish reason "
                f"for every sample ({len(run.result.outputs)})"
            )
        else:
            print(f"NOT identical to the unmigrated run: {mismatch}")
    return 0 if mismatch is None else EXIT_FAILED


def _moves_summary(run: MigratedRun) -> str:
    if not run.moves:
        return f"no move: the request finished in {run.steps} steps"
    sent = [m for m in run.moves if m.kv_mode == "transfer"]
    total = sum(m.report.kv_bytes for m in sent)
    return (
        f"moved {len(run.moves)} times in {run.steps} steps: {len(sent)} by transfer "
        f"({total:,} bytes of KV sent), {len(run.moves) - len(sent)} by recompute"
    )


def _migration_json(run: MigratedRun, plan: MigrationPlan, mismatch: str | None) -> object:
    return {
        "engines": {
            name: {"block_size": c.block_size, "num_blocks": c.num_blocks}
            for name, c in run.engines.items()
        },
        "every": plan.every,
        "kv": plan.kv.value,
        "chunk_blocks": plan.chunk_blocks,
        "steps": run.steps,
        "moves": [m.to_json() for m in run.moves],
        "identical": mismatch is None,
        "difference": mismatch,
    }


def _speculation(s: SpeculationStats) -> dict[str, object]:
    return {
        "num_verifications": s.num_verifications,
        "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_per_verification": s.mean_accepted,
    }


def generate_main(argv: Sequence[str] | None = None) -> int:
    """``refserve generate`` alone; same options, same error surface."""
    from refserve.cli.args import ArgumentParser, run_cli

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]

    def command() -> int:
        p = ArgumentParser(prog="refserve generate")
        _add_args(p)
        return run_generate(p.parse_args(args))

    return run_cli(command, debug=debug)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(generate_main())
