"""File handling every command-line input and output shares, and how hostile values are
shown in messages.

:func:`read_text_file` (size cap, strict UTF-8, the line of a bad byte), :func:`loads_json`
(duplicate keys, nesting and huge numbers refused as typed errors),
:func:`check_output_file` / :func:`check_output_dir` (run before the work starts) and
:func:`atomic_write_text` (a temporary name renamed into place, so an interrupted run
never leaves a half-written file). Below every layer but ``refserve.errors``: the model loader,
the simulator's traces and the reports all read and write through it.
"""

from __future__ import annotations

import codecs
import contextlib
import itertools
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

from refserve.errors import InputFileError, InvalidArgument, OutputPathError


# ------------------------------------------------------------------ showing values
def show(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about hostile input.

    An int of thousands of digits is described, not printed (its repr alone can raise).
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 160:
        return f"an int of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return clip(repr(value), limit)


def clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(path: str | os.PathLike[str]) -> str:
    """A path as printable text: bytes that are not UTF-8 (surrogate-escaped by Python)
    become ``\\udcXX`` escapes instead of failing the print."""
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


# ------------------------------------------------------------------ reading input files
def exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long, a NUL byte: nothing by that name
        return False


def read_text_file(
    path: Path, what: str, max_bytes: int, error: type[InvalidArgument] = InputFileError
) -> str:
    """The file's text, UTF-8 (a leading BOM dropped), read in full only if it is at most
    ``max_bytes``; every failure is an ``error`` naming the file (and the line of a bad
    byte)."""
    name = shown(path)
    try:
        if path.is_dir():
            raise error(f"{what} {name}: is a directory, expected a file")
        # Read one byte past the cap instead of trusting stat(): pipes and /dev files
        # report size 0.
        with path.open("rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{what} {name}: cannot read: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise error(f"{what} {name}: larger than {max_bytes >> 20} MiB, the limit")
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(
            f"{what} {name}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def _no_duplicate_keys(where: str, error: type[InvalidArgument]) -> Callable[..., object]:
    def hook(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in pairs:
            if k in out:
                raise error(f"{where}: duplicate key {clip(repr(k))}")
            out[k] = v
        return out

    return hook


def loads_json(text: str, where: str, error: type[InvalidArgument] = InputFileError) -> object:
    """``json.loads`` for untrusted text: every failure is an ``error`` naming ``where``.

    Duplicate keys are refused (the last one would silently win). ``NaN`` and
    ``Infinity`` decode to floats so that the field check that follows names the field.
    """
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys(where, error))
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # an int past Python's digit limit, say
        if isinstance(e, InvalidArgument):
            raise
        raise error(f"{where}: JSON holds a number that cannot be read ({clip(str(e))})") from None


# ------------------------------------------------------------------ writing output files
def check_output_file(path: Path, what: str) -> Path:
    """Check before a run that ``path`` can be written; create its parent directories.

    Refused (:class:`OutputPathError` naming ``what``): a directory, a path under a file,
    an existing file that is not a regular one (``/dev/null`` would be replaced), a
    directory where a file cannot be created. Returns the path to write (a symlink's
    target, so the link survives the atomic rename).
    """
    name = shown(path)
    if "\x00" in str(path):  # pathlib answers "no such file" for it; open() raises later
        raise OutputPathError(f"{what} {name!r}: a file name cannot hold a NUL byte")
    try:
        if path.is_symlink():
            path = Path(os.path.realpath(path))
        if path.is_dir() or path.name in ("", ".", ".."):
            raise OutputPathError(f"{what} {name}: is a directory; give a file name")
        if path.exists() and not path.is_file():
            raise OutputPathError(f"{what} {name}: exists and is not a regular file")
        _make_dir(path.parent, what, name)
        _probe_writable(path.parent, what, name)
    except OSError as e:
        raise OutputPathError(f"{what} {name}: {e.strerror or e}") from None
    return path


def check_output_dir(path: Path, what: str) -> Path:
    """Like :func:`check_output_file` for a folder: created if missing, refused if it is a
    file or under one, or if files cannot be created in it."""
    name = shown(path)
    if "\x00" in str(path):
        raise OutputPathError(f"{what} {name!r}: a directory name cannot hold a NUL byte")
    try:
        if path.exists() and not path.is_dir():
            raise OutputPathError(f"{what} {name}: exists and is not a directory")
        _make_dir(path, what, name)
        _probe_writable(path, what, name)
    except OSError as e:
        raise OutputPathError(f"{what} {name}: {e.strerror or e}") from None
    return path


def _make_dir(directory: Path, what: str, name: str) -> None:
    # The nearest existing ancestor must be a directory: 'report.json/x.svg' is refused
    # by name here rather than by an ENOTDIR from mkdir.
    ancestor = directory
    while not exists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if exists(ancestor) and not ancestor.is_dir():
        raise OutputPathError(f"{what} {name}: {shown(ancestor)} is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(
            f"{what} {name}: cannot create directory {shown(directory)}: {e.strerror or e}"
        ) from None


_counter = itertools.count()


def temp_name(path: Path) -> Path:
    """A hidden name beside ``path`` (same filesystem, so a rename onto ``path`` is
    atomic), unique per process and call."""
    return path.with_name(f".{path.name}.{os.getpid()}.{next(_counter)}.tmp")


def _probe_writable(directory: Path, what: str, name: str) -> None:
    # Create and remove a file rather than ask os.access: root passes access() checks on
    # read-only mounts and /proc, where creating a file still fails.
    probe = temp_name(directory / "probe")
    try:
        with probe.open("x", encoding="utf-8"):
            pass
    except OSError as e:
        raise OutputPathError(
            f"{what} {name}: cannot write in {shown(directory)}: {e.strerror or e}"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def atomic_write_text(path: Path, text: str, what: str = "output") -> Path:
    """Write ``text`` to a temporary name beside ``path`` and rename it into place.

    An interrupt (Ctrl-C) or an error part-way leaves ``path`` as it was and no temporary
    file behind. An OS failure (disk full) is an :class:`OutputPathError` naming the path.
    """
    tmp = temp_name(path)
    try:
        with tmp.open("x", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise OutputPathError(f"{what} {shown(path)}: cannot write: {reason}") from None
    finally:
        # On success the temporary name no longer exists; on any failure (KeyboardInterrupt
        # included) it is removed so nothing half-written is left.
        with contextlib.suppress(OSError):
            tmp.unlink()
    return path
