"""``refserve generate``: one prompt through the real engine, tokens and text printed.

Ready to be wired into ``ref/cli.py`` (two lines: ``add_generate_parser(sub)`` in
``_parser``); until then ``python -m ref.generate_cli ...`` runs it standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ref.errors import InvalidArgument, RefserveError


def add_generate_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to an ``add_subparsers()`` object."""
    p: argparse.ArgumentParser = sub.add_parser(
        "generate", help="generate from a prompt with the real model (tiny or a local checkpoint)"
    )
    _add_args(p)
    p.set_defaults(func=run_generate)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="'tiny' (embedded) or a local HF checkpoint dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="parallel samples (forks of one prompt)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--attention-backend", choices=["torch", "triton"], default="torch")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print ids, finish reason and metrics")


def run_generate(args: argparse.Namespace) -> int:
    from ref.engine import LLMEngine
    from ref.sampler import SamplingParams

    prompt: str | list[int]
    if args.prompt_ids is not None:
        try:
            prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as e:
            raise InvalidArgument(f"--prompt-ids must be comma-separated ints: {e}") from e
    else:
        prompt = args.prompt
    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    engine = LLMEngine(args.model, attention_backend=args.attention_backend, device=args.device)
    (result,) = engine.generate([prompt], params)
    if args.json:
        doc = {
            "model": args.model,
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
                    },
                }
                for o in result.outputs
            ],
        }
        print(json.dumps(doc, indent=2))
        return 0
    for o in result.outputs:
        tag = f"[{o.index}] " if len(result.outputs) > 1 else ""
        print(f"{tag}tokens: {' '.join(map(str, o.token_ids))}")
        print(f"{tag}text:   {o.text!r}")
        print(f"{tag}finish: {o.finish_reason}")
    return 0


def generate_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="refserve generate", description=__doc__)
    _add_args(p)
    args = p.parse_args(argv)
    try:
        return run_generate(args)
    except RefserveError as e:
        print(f"refserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(generate_main())
