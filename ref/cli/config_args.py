"""The scheduler's options, shared by ``refserve simulate``, ``serve`` and ``generate``:
one owner, so the commands take the same flags with the same limits and none imports
another."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from refserve.cli.args import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    MAX_KV_BYTES_PER_TOKEN,
    MAX_SEQS,
    MAX_TOKENS,
    finite_float,
    int_at_most,
)

if TYPE_CHECKING:  # the scheduler is imported when a command runs, not at startup
    from refserve.core.config import SchedulerConfig
    from refserve.spec.groups import KVGroup


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The options :func:`config_from_args` reads (a ``SchedulerConfig`` and its cost)."""
    from refserve.core.config import Admission, PolicyName
    from refserve.core.swap import PreemptionMode

    tokens, blocks = int_at_most(MAX_TOKENS), int_at_most(MAX_BLOCKS)
    p.add_argument(
        "--max-num-batched-tokens",
        type=tokens,
        default=2048,
        metavar="N",
        help=f"token budget of one step, prompt chunks and decodes together (default "
        f"%(default)s; 1 to {MAX_TOKENS:,})",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int_at_most(MAX_SEQS),
        default=256,
        metavar="N",
        help=f"requests running at once (default %(default)s; 1 to {MAX_SEQS:,})",
    )
    p.add_argument(
        "--block-size",
        type=int_at_most(MAX_BLOCK_SIZE),
        default=16,
        metavar="TOKENS",
        help=f"tokens per KV block (default %(default)s; 1 to {MAX_BLOCK_SIZE:,})",
    )
    p.add_argument(
        "--num-blocks",
        type=blocks,
        default=4096,
        metavar="N",
        help=f"KV blocks in the device pool (default %(default)s; 1 to {MAX_BLOCKS:,})",
    )
    p.add_argument(
        "--kv-groups",
        type=_layout,
        default=(),
        metavar="LAYOUT",
        help="the model's KV layer groups, comma-separated, the first full attention: "
        "full, window:W (a sliding window of W tokens), compressed:R (one entry per R "
        "tokens); e.g. full,window:4096. Default: one full group, the plain pool",
    )
    p.add_argument(
        "--max-model-len",
        type=tokens,
        default=1 << 20,
        metavar="TOKENS",
        help=f"longest request, prompt plus output (default %(default)s; 1 to {MAX_TOKENS:,})",
    )
    p.add_argument(
        "--cost",
        default="2+0.5P+D",
        help="step cost in ms, a + b*P prefill tokens + c*D decodes (+ e*K KV tokens read), "
        "written like %(default)s (the default): the simulator's clock, and what a swap "
        "is weighed against with --kv-bytes-per-token",
    )
    p.add_argument(
        "--policy",
        choices=[x.value for x in PolicyName],
        default=PolicyName.DECODE_FIRST.value,
        help="which requests a step serves first (default %(default)s)",
    )
    p.add_argument(
        "--admission",
        choices=[x.value for x in Admission],
        default=Admission.FIRST_CHUNK.value,
        help="KV a waiting request must get before it is admitted: its first chunk, its "
        "whole prompt, or prompt plus max_tokens, which never preempts (default %(default)s)",
    )
    p.add_argument(
        "--watermark-blocks",
        type=blocks,
        default=0,
        metavar="N",
        help="blocks kept free at admission for running requests to grow into (default "
        "%(default)s; below --num-blocks)",
    )
    p.add_argument(
        "--align-chunks", action="store_true", help="end partial chunks on block boundaries"
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the KV blocks of a prompt prefix seen before",
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="schedule a prompt whole or not at all, never split over steps",
    )
    p.add_argument(
        "--preemption-mode",
        choices=[x.value for x in PreemptionMode],
        default=PreemptionMode.RECOMPUTE.value,
        help="what happens to a preempted request's KV: dropped and recomputed, swapped "
        "to the host, or whichever is predicted cheaper (default %(default)s; swap and auto "
        "need --num-host-blocks, auto also --kv-bytes-per-token)",
    )
    p.add_argument(
        "--num-host-blocks",
        type=blocks,
        default=0,
        metavar="N",
        help=f"host swap pool size in blocks (default %(default)s: none; at most {MAX_BLOCKS:,})",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int_at_most(MAX_KV_BYTES_PER_TOKEN),
        metavar="BYTES",
        help="K+V bytes of one token over all layers, which prices a swap (e.g. 524288 for a "
        "7B model in fp16; default: swaps are not priced)",
    )
    p.add_argument(
        "--swap-link-gbps",
        type=finite_float(0, 1e6, lo_open=True),
        default=25.0,
        metavar="GBPS",
        help="host link bandwidth in GB/s, with --kv-bytes-per-token (default %(default)s)",
    )
    mlfq = p.add_argument_group(
        "skip-join MLFQ (--policy mlfq)",
        "levels of growing quanta, service priced by --cost (ref/core/mlfq.py)",
    )
    mlfq.add_argument(
        "--mlfq-queues",
        type=int_at_most(16),
        default=4,
        metavar="K",
        help="number of levels (default %(default)s; 1 to 16)",
    )
    mlfq.add_argument(
        "--mlfq-quantum-ms",
        type=finite_float(0, 1e6, lo_open=True),
        default=8.0,
        metavar="MS",
        help="level 0's quantum of service in ms (default %(default)s)",
    )
    mlfq.add_argument(
        "--mlfq-growth",
        type=finite_float(1, 16),
        default=2.0,
        metavar="X",
        help="each level's quantum is X times the one above (default %(default)s; 1 to 16)",
    )
    mlfq.add_argument(
        "--mlfq-starvation-steps",
        type=int_at_most(1 << 30),
        default=256,
        metavar="N",
        help="a request waiting N steps below level 0 is promoted to it (default %(default)s)",
    )
    mlfq.add_argument(
        "--mlfq-no-skip-join",
        action="store_true",
        help="every new request joins level 0 (the classic MLFQ) instead of the highest "
        "level whose quantum covers its first chunk",
    )
    mlfq.add_argument(
        "--mlfq-no-proactive-swap",
        action="store_true",
        help="displaced requests are preempted by --preemption-mode (recompute by default) "
        "instead of keeping their K/V on the host, and no running request moves to the "
        "host ahead of a block shortage",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check every spec invariant after every step (slower; a violation is an error)",
    )


def _layout(text: str) -> tuple[KVGroup, ...]:
    from refserve.spec.groups import parse_layout

    try:
        groups = parse_layout(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    for g in groups:
        if max(g.window, g.ratio) > MAX_TOKENS:
            raise argparse.ArgumentTypeError(f"{g.kind} group: at most {MAX_TOKENS:,} tokens")
    return () if len(groups) == 1 and groups[0].ratio == 1 else groups


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    """The ``SchedulerConfig`` the options of :func:`add_config_args` describe."""
    from refserve.core.config import Admission, PolicyName, SchedulerConfig
    from refserve.core.cost import StepCost
    from refserve.core.mlfq_settings import MlfqSettings
    from refserve.core.swap import PreemptionMode, SwapCost

    return SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_groups=args.kv_groups,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        align_chunks_to_blocks=args.align_chunks,
        admission=Admission(args.admission),
        watermark_blocks=args.watermark_blocks,
        policy=PolicyName(args.policy),
        preemption_mode=PreemptionMode(args.preemption_mode),
        num_host_blocks=args.num_host_blocks,
        swap_cost=(
            SwapCost(
                args.kv_bytes_per_token,
                args.swap_link_gbps,
                iteration=StepCost.parse(args.cost),
            )
            if args.kv_bytes_per_token is not None
            else None
        ),
        mlfq=MlfqSettings(
            num_queues=args.mlfq_queues,
            base_quantum_ms=args.mlfq_quantum_ms,
            quantum_growth=args.mlfq_growth,
            starvation_steps=args.mlfq_starvation_steps,
            skip_join=not args.mlfq_no_skip_join,
            proactive_swap=not args.mlfq_no_proactive_swap,
            cost=StepCost.parse(args.cost),
        ),
    )
