"""Typed errors of the engine. Every one names what was wrong; none leaves state changed."""

from __future__ import annotations


class RefserveError(Exception):
    """Base of every error refserve raises on purpose."""


class InvalidArgument(RefserveError, ValueError):
    """A value is out of its documented range (a token count of 0, a block size of 0, ...)."""


class UnknownRequest(RefserveError, LookupError):
    """An operation named a request id the component does not hold."""

    def __init__(self, request_id: str, what: str) -> None:
        super().__init__(f"{what}: unknown request id {request_id!r}")
        self.request_id = request_id


class DuplicateRequest(RefserveError, ValueError):
    """A request id is already in use."""

    def __init__(self, request_id: str, what: str) -> None:
        super().__init__(f"{what}: request id {request_id!r} is already in use")
        self.request_id = request_id


class OutOfBlocks(RefserveError):
    """The pool has too few free blocks right now; freeing or preempting may help."""

    def __init__(self, request_id: str, needed: int, free: int) -> None:
        super().__init__(f"request {request_id!r} needs {needed} free KV blocks, {free} are free")
        self.request_id = request_id
        self.needed = needed
        self.free = free


class ExceedsCapacity(RefserveError):
    """The request can never fit: it needs more blocks than the whole pool has."""

    def __init__(self, request_id: str, needed: int, num_blocks: int) -> None:
        super().__init__(
            f"request {request_id!r} needs {needed} KV blocks but the pool has only {num_blocks}"
        )
        self.request_id = request_id
        self.needed = needed
        self.num_blocks = num_blocks


class QueueFull(RefserveError):
    """Admission control: the waiting queue is at ``max_waiting``; try again later."""


class UsageError(InvalidArgument):
    """A command line the CLI cannot parse (an unknown option, a value of the wrong kind)."""


class OutputPathError(InvalidArgument):
    """An output path cannot be written: a directory, a path under a file, or unwritable.

    The CLI checks every output path before a run starts, so a long run never fails at its
    end for want of a place to put the result.
    """


class InputFileError(InvalidArgument):
    """An input file cannot be read as what it should be: missing, a directory, too large,
    not UTF-8, or JSON that is malformed or nested too deeply. The message names the file."""
