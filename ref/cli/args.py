"""What every ``refserve`` subcommand shares: the one error surface (:func:`run_cli`), the
exit statuses, and argparse with one-line usage errors and bounded, typed option values.

The error surface is described in :mod:`refserve.cli.main`: a typed error prints one line
``refserve: error: ...`` and exits 2, Ctrl-C exits 130, any other exception is an internal
error (one line, exit 2), ``--debug`` adds the traceback; exit 1 is a check that ran and
failed. Limits of the options: block pools at most ``MAX_BLOCKS`` blocks (a pool is a
Python list: 2**22 blocks take about a second to build), token counts at most
``MAX_TOKENS``, ``--max-steps`` at most ``MAX_STEPS``, every float finite.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from refserve.errors import InvalidArgument, RefserveError, UsageError

if TYPE_CHECKING:  # the model is imported when a command runs, not at startup
    from refserve.engine.llm_engine import Proposer

#: Drafts per step (``--num-speculative-tokens``): each is a position of the forward.
MAX_DRAFTS = 64

PROG = "refserve"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
MAX_BLOCKS = 1 << 22
MAX_TOKENS = (1 << 31) - 1
MAX_BLOCK_SIZE = 1 << 16
MAX_SEQS = 1 << 20
MAX_STEPS = 100_000_000
MAX_KV_BYTES_PER_TOKEN = 1 << 40
MAX_MESSAGE_CHARS = 1000


def run_cli(command: Callable[[], int], *, debug: bool = False) -> int:
    """Run a command under the one error surface; return its exit status."""
    try:
        return command()
    except SystemExit as e:  # --help: argparse prints and exits 0
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USAGE)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly; point stdout at /dev/null so the
        # interpreter's final flush does not fail again.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except (KeyboardInterrupt, Exception) as e:
        if debug:
            traceback.print_exc()
        failure = _failure(e)
        _say(failure.message)
        return failure.status


@dataclass(frozen=True)
class _Failure:
    """How a command that raised ends: the one line said, and the exit status."""

    message: str
    status: int


def _failure(e: BaseException) -> _Failure:
    """The line and exit status for an exception the command raised (first match wins:
    a typed error is bad input, an OSError a file the OS refused that no check foresaw,
    anything else a bug in refserve)."""
    if isinstance(e, KeyboardInterrupt):
        return _Failure("interrupted", EXIT_INTERRUPTED)
    if isinstance(e, RefserveError):
        return _Failure(f"error: {e}", EXIT_USAGE)
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename is not None else ""
        return _Failure(f"error: {where}{e.strerror or e}", EXIT_USAGE)
    if isinstance(e, MemoryError):
        return _Failure(
            "error: out of memory (the input asks for more than this machine has)", EXIT_USAGE
        )
    return _Failure(
        f"error: internal error: {type(e).__name__}: {e} (--debug shows the traceback)",
        EXIT_USAGE,
    )


def _say(message: str) -> None:
    """One line on stderr, whatever the message holds (newlines, thousands of digits)."""
    text = " ".join(message.splitlines()) or message
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 3] + "..."
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are :class:`UsageError` (one line, exit 2 via
    :func:`run_cli`) instead of a usage block and ``sys.exit(2)``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{clip(message, 300)} (see '{self.prog} --help')")


def add_command(sub: Any, name: str, summary: str) -> argparse.ArgumentParser:
    """Add subcommand ``name`` to an ``add_subparsers()`` object: ``summary`` is its line in
    ``refserve --help`` and the head of its own ``--help``."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=summary, description=summary)
    return p


def clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def int_at_most(hi: int, lo: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int, at most ``hi`` (and at least ``lo`` when given). Lower
    bounds are otherwise left to the config objects, whose messages name the field."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also past Python's 4300-digit limit
            raise argparse.ArgumentTypeError(f"expected an int, got {clip(text)!r}") from None
        if value > hi or (lo is not None and value < lo):
            bounds = f"at most {hi}" if lo is None else f"an int in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {clip(text)}")
        return value

    return parse


def finite_float(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {clip(text)!r}") from None
        above = value > lo if lo_open else value >= lo
        if not (above and value <= hi):  # NaN fails every comparison
            left = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(
                f"must be a finite number in {left}{lo:g}, {hi:g}], got {clip(text)}"
            )
        return value

    return parse


def check_device(text: str, option: str = "--device") -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` on a machine that has it; anything else is refused
    by name before a model is built (torch would fail deep inside, or, for ``meta``,
    load tensors without data)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise InvalidArgument(f"{option} {text!r}: not a device (use cpu or cuda[:N])") from None
    if device.type == "cpu":
        return text
    if device.type != "cuda":
        raise InvalidArgument(f"{option} {text!r}: only cpu and cuda[:N] are supported")
    if not torch.cuda.is_available():
        raise InvalidArgument(f"{option} {text!r}: CUDA is not available on this machine")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise InvalidArgument(f"{option} {text!r}: this machine has {count} CUDA device(s)")
    return text


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--attention-backend``, where the model runs;
    :func:`check_device_args` checks them before a model is built."""
    p.add_argument(
        "--device",
        default="cpu",
        help="where the model runs: cpu, cuda or cuda:N (default %(default)s)",
    )
    p.add_argument(
        "--attention-backend",
        choices=["torch", "triton"],
        default="torch",
        help="paged attention in plain torch, or the Triton kernels (needs a CUDA device, "
        "or TRITON_INTERPRET=1 on a CPU; default %(default)s)",
    )


def check_device_args(args: argparse.Namespace) -> None:
    """The options of :func:`add_device_args`: the device exists here, and the backend can
    run on it."""
    check_device(args.device)
    backend, device = args.attention_backend, args.device
    if backend != "triton" or device.startswith("cuda"):
        return
    # Triton has no CPU backend: its kernels run on CPU tensors only in interpreter mode,
    # which must be on before the kernels are imported (kernels/_runtime.py).
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidArgument(
            f"--attention-backend triton needs a CUDA device (--device {device}); on a CPU "
            "start with TRITON_INTERPRET=1 (the slow interpreter) or use --attention-backend "
            "torch"
        )


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """``--speculative ngram|draft:DIR`` and ``--num-speculative-tokens K``
    (docs/SPECULATIVE.md); :func:`proposer_from_args` reads them."""
    p.add_argument(
        "--speculative",
        metavar="ngram|draft:DIR",
        help="speculative decoding: n-gram prompt lookup, or a smaller draft checkpoint "
        "(a local HF dir sharing the model's vocabulary); reports the acceptance rate",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int_at_most(MAX_DRAFTS),
        default=3,
        metavar="K",
        help=f"drafts verified per step with --speculative (1 to {MAX_DRAFTS}; default "
        "%(default)s)",
    )


def proposer_from_args(args: argparse.Namespace) -> Proposer | None:
    """The proposer ``--speculative`` names: ``ngram``, or ``draft:DIR`` (a checkpoint
    loaded on ``--device``); None without the option."""
    choice, k = args.speculative, args.num_speculative_tokens
    if choice is None:
        return None
    from refserve.model.proposers import DraftModelProposer, NgramProposer

    if k < 1:
        raise InvalidArgument(f"--num-speculative-tokens must be >= 1, got {k}")
    if choice == "ngram":
        return NgramProposer(k)
    kind, _, path = choice.partition(":")
    if kind != "draft" or not path:
        raise InvalidArgument(
            f"--speculative: {choice!r}; expected 'ngram' or 'draft:DIR' (a checkpoint dir)"
        )
    from refserve.model.attention import TorchAttention
    from refserve.model.llama import LlamaModel
    from refserve.model.weights import load_checkpoint

    if not os.path.isdir(path):
        raise InvalidArgument(f"--speculative draft:{path}: no such checkpoint directory")
    cfg, weights = load_checkpoint(path, device=getattr(args, "device", "cpu"))
    return DraftModelProposer(LlamaModel(cfg, weights, TorchAttention()), k)
