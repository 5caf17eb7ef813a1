"""The check every patch module makes before it touches an engine: the installed code is
the code its hunk was read from, or the patch would put back (or fix) something else."""

from __future__ import annotations

import inspect
import textwrap
import types
from collections.abc import Sequence
from typing import Any


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


def with_statement_reversed(fn: Any, module: types.ModuleType, fixed: str, buggy: str) -> Any:
    """``fn``, an engine's function or method, recompiled from its installed source with
    the one statement ``fixed`` replaced by ``buggy``; its globals are ``module``'s own
    (live: nothing is copied or written into the module). For a hunk of one statement in
    a function too long to copy; :class:`HunkNotFound` unless ``fixed`` occurs exactly
    once. The caller binds the result to the objects its factory builds."""
    source = textwrap.dedent(inspect.getsource(fn))
    if source.count(fixed) != 1:
        name = getattr(fn, "__qualname__", repr(fn))
        raise HunkNotFound(f"the installed {name} does not hold {fixed!r} exactly once")
    filename = inspect.getsourcefile(fn) or f"<{module.__name__}>"
    # The definition is executed against a copy of the module's globals (its annotations
    # are evaluated there), then the code is bound to the module's live globals.
    namespace: dict[str, Any] = dict(vars(module))
    exec(compile(source.replace(fixed, buggy), filename, "exec"), namespace)
    built = namespace[fn.__name__]
    return types.FunctionType(
        built.__code__, vars(module), built.__name__, built.__defaults__, built.__closure__
    )
