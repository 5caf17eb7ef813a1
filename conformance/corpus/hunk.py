"""The check every patch module makes before it touches an engine: the installed code is
the code its hunk was read from, or the patch would put back (or fix) something else."""

from __future__ import annotations

import inspect
from collections.abc import Sequence


class HunkNotFound(ImportError):
    """The installed engine does not have the lines a patch module was written against."""


def require_lines(bug: str, code: object, lines: Sequence[str], absent: Sequence[str] = ()) -> None:
    """Raise :class:`HunkNotFound`, naming ``bug``, the function or class and the lines,
    unless ``code``'s installed source holds every one of ``lines`` and none of ``absent``."""
    src = inspect.getsource(code)  # type: ignore[arg-type]  # a function or class of the engine
    missing = [line for line in lines if line not in src]
    present = [line for line in absent if line in src]
    if missing or present:
        name = getattr(code, "__qualname__", repr(code))
        what = []
        if missing:
            what.append(f"lacks {missing!r}")
        if present:
            what.append(f"already has {present!r}")
        raise HunkNotFound(
            f"{bug} cannot be applied: the installed {name} {' and '.join(what)} "
            "(the patch was written against another release)"
        )
