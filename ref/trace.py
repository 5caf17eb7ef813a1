"""Workload traces: JSONL, one request per line; and the file checks every CLI input shares.

Fields: ``id`` (printable str of at most 256 characters), ``arrival_ms`` (a finite number
in [0, 1e12], non-decreasing down the file), either ``prompt_len`` (int in [1, 2**24]) or
``prompt_token_ids`` (non-empty list of at most 2**24 ints in [0, 2**31)), ``output_len``
(int in [1, 2**24]); optional ``priority`` (int in [-2**31, 2**31)), ``tenant`` (str like
``id``), ``prefix_group`` (str like ``id``, only with ``prompt_len``) with ``prefix_len``
(requests of one group share their first ``prefix_len`` prompt tokens; by default half
the prompt). A whole trace holds at most 2**24 prompt tokens and its file at most 64 MiB.
Any other field, a bad value (``NaN`` and ``Infinity`` included), a duplicate key, an
out-of-order arrival or a duplicate id raises :class:`TraceError` naming the file and
line; nothing is half-loaded. Limits are checked before any token list is built.

The second half of this module is the file handling the CLI uses for every input and
output: :func:`read_text_file` (size cap, strict UTF-8, the line of a bad byte),
:func:`loads_json` (duplicate keys, nesting and huge numbers refused as typed errors),
:func:`check_output_file` / :func:`check_output_dir` (run before the work starts) and
:func:`atomic_write_text` (a temporary name renamed into place, so an interrupted run
never leaves a half-written file).
"""

from __future__ import annotations

import codecs
import contextlib
import itertools
import json
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ref.errors import InputFileError, InvalidArgument, OutputPathError
from ref.request import Request, StopParams

FIELDS = frozenset(
    {
        "id",
        "arrival_ms",
        "prompt_len",
        "prompt_token_ids",
        "output_len",
        "priority",
        "tenant",
        "prefix_group",
        "prefix_len",
    }
)
BUILTIN = ("seed000_decode", "seed001", "seed002", "shared_prefix", "memory_pressure")

#: Limits of a trace (documented above). Tokens of ``prompt_len`` lines are built in
#: memory (a Python int each), so the total is what bounds a load's time and memory:
#: 2**24 tokens take a few seconds and under 1 GiB.
MAX_TRACE_BYTES = 64 << 20
MAX_REQUEST_TOKENS = 1 << 24
MAX_TRACE_TOKENS = 1 << 24
MAX_TOKEN_ID = (1 << 31) - 1
MAX_ARRIVAL_MS = 1e12  # about 32 years: past it float ms lose sub-microsecond steps
MAX_NAME_CHARS = 256
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)


class TraceError(InvalidArgument):
    """A trace line is malformed; the message names the source and line number."""


@dataclass(frozen=True)
class TraceRequest:
    id: str
    arrival_ms: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    priority: int = 0
    tenant: str = "default"

    def to_request(self) -> Request:
        return Request(
            self.id,
            list(self.prompt_token_ids),
            StopParams(max_tokens=self.output_len, ignore_eos=True),
            arrival_ms=self.arrival_ms,
            priority=self.priority,
            tenant=self.tenant,
        )


def builtin_path(name: str) -> Path:
    return Path(str(resources.files("ref") / "traces" / f"{name}.jsonl"))


def load_trace(source: str | Path, *, max_model_len: int | None = None) -> list[TraceRequest]:
    """Load a JSONL trace from a path, or a built-in trace by name (see ``BUILTIN``).

    ``max_model_len``: refuse a prompt longer than this before its tokens are built.
    A file without requests is refused too (a run over nothing is a mistake, not a result).
    """
    path = Path(source)
    if str(source) in BUILTIN and not _exists(path):
        path = builtin_path(str(source))
    if not _exists(path):
        raise TraceError(
            f"trace {shown(source)!r}: no such file (built-in traces: {', '.join(BUILTIN)})"
        )
    text = read_text_file(path, "trace", MAX_TRACE_BYTES, TraceError)
    out = parse_trace(text, shown(path), max_model_len=max_model_len)
    if not out:
        raise TraceError(f"trace {shown(path)}: holds no requests")
    return out


def parse_trace(
    text: str, name: str = "<trace>", *, max_model_len: int | None = None
) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    seen: set[str] = set()
    groups: dict[str, list[int]] = {}
    last_arrival = 0.0
    total_tokens = 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        obj = loads_json(line, where, TraceError)
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - FIELDS)
        if unknown:
            raise TraceError(
                f"{where}: unknown field(s) {', '.join(_clip(u) for u in unknown[:5])}; "
                f"allowed: {', '.join(sorted(FIELDS))}"
            )
        rid = _name(obj.get("id"), "id", where)
        if rid in seen:
            raise TraceError(f"{where}: duplicate request id {rid!r}")
        seen.add(rid)
        arrival = obj.get("arrival_ms", 0.0)
        # Compare before float(): an int of 400 digits would overflow it; NaN fails both.
        if (
            isinstance(arrival, bool)
            or not isinstance(arrival, int | float)
            or not 0 <= arrival <= MAX_ARRIVAL_MS
        ):
            raise TraceError(
                f"{where}: 'arrival_ms' must be a finite number in [0, {MAX_ARRIVAL_MS:g}], "
                f"got {show(arrival)}"
            )
        if arrival < last_arrival:
            raise TraceError(
                f"{where}: arrival_ms {arrival} is before the previous line's {last_arrival}"
            )
        last_arrival = float(arrival)
        output_len = _positive_int(obj.get("output_len"), "output_len", where)
        priority = obj.get("priority", 0)
        lo, hi = PRIORITY_RANGE
        if isinstance(priority, bool) or not isinstance(priority, int) or not lo <= priority <= hi:
            raise TraceError(
                f"{where}: 'priority' must be an int in [{lo}, {hi}], got {show(priority)}"
            )
        tenant = _name(obj.get("tenant", "default"), "tenant", where)
        n = _prompt_len(obj, where)
        if max_model_len is not None and n > max_model_len:
            # The scheduler would refuse it too, but only after the tokens were built.
            raise TraceError(
                f"{where}: request {rid!r} prompt has {n} tokens; max_model_len is {max_model_len}"
            )
        total_tokens += n
        if total_tokens > MAX_TRACE_TOKENS:
            raise TraceError(
                f"{where}: the trace holds more than {MAX_TRACE_TOKENS} prompt tokens "
                "(the limit of one trace)"
            )
        prompt = _prompt(obj, n, where, rid, groups)
        out.append(TraceRequest(rid, float(arrival), prompt, output_len, priority, tenant))
    return out


def _prompt_len(obj: dict[str, object], where: str) -> int:
    """The prompt's length, checked, before any token is built."""
    if ("prompt_len" in obj) == ("prompt_token_ids" in obj):
        raise TraceError(f"{where}: give exactly one of 'prompt_len' or 'prompt_token_ids'")
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            raise TraceError(f"{where}: 'prompt_token_ids' must be a non-empty list")
        if len(ids) > MAX_REQUEST_TOKENS:
            raise TraceError(
                f"{where}: 'prompt_token_ids' holds {len(ids)} tokens; at most "
                f"{MAX_REQUEST_TOKENS} per request"
            )
        for field_name in ("prefix_group", "prefix_len"):
            if field_name in obj:
                raise TraceError(f"{where}: '{field_name}' applies only with 'prompt_len'")
        return len(ids)
    return _positive_int(obj.get("prompt_len"), "prompt_len", where)


def _prompt(
    obj: dict[str, object], n: int, where: str, rid: str, groups: dict[str, list[int]]
) -> tuple[int, ...]:
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        assert isinstance(ids, list)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
                raise TraceError(f"{where}: 'prompt_token_ids' holds a bad token id {show(t)}")
        return tuple(ids)
    group_value = obj.get("prefix_group")
    if group_value is None and "prefix_len" in obj:
        raise TraceError(f"{where}: 'prefix_len' needs 'prefix_group'")
    group = None if group_value is None else _name(group_value, "prefix_group", where)
    plen = obj.get("prefix_len", n // 2)
    if isinstance(plen, bool) or not isinstance(plen, int) or not 0 <= plen <= n:
        raise TraceError(f"{where}: 'prefix_len' must be an int in 0..{n}, got {show(plen)}")
    # Synthetic tokens, deterministic per request id; a prefix group shares its head.
    rng = random.Random(rid)
    tokens = [rng.randrange(256, 32000) for _ in range(n)]
    if group is not None:
        shared = groups.setdefault(
            group, [random.Random(f"group:{group}").randrange(256, 32000) for _ in range(n)]
        )
        while len(shared) < plen:
            shared.append(random.Random(f"group:{group}:{len(shared)}").randrange(256, 32000))
        tokens[:plen] = shared[:plen]
    return tuple(tokens)


def _positive_int(value: object, field: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: '{field}' must be an int >= 1, got {show(value)}")
    if value > MAX_REQUEST_TOKENS:
        raise TraceError(
            f"{where}: '{field}' is {show(value)}; at most {MAX_REQUEST_TOKENS} tokens per request"
        )
    return value


def _name(value: object, field: str, where: str) -> str:
    """An id-like string: non-empty, short, printable (no control characters, no lone
    surrogates: either would break the tables and files the run writes)."""
    if not isinstance(value, str) or not value:
        raise TraceError(f"{where}: '{field}' must be a non-empty string, got {show(value)}")
    if len(value) > MAX_NAME_CHARS:
        raise TraceError(
            f"{where}: '{field}' has {len(value)} characters; at most {MAX_NAME_CHARS}"
        )
    if not value.isprintable():
        raise TraceError(
            f"{where}: '{field}' must be printable text (no control characters or lone "
            f"surrogates), got {show(value)}"
        )
    return value


# ------------------------------------------------------------------ showing values
def show(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about hostile input.

    An int of thousands of digits is described, not printed (its repr alone can raise).
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 160:
        return f"an int of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return _clip(repr(value), limit)


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(path: str | os.PathLike[str]) -> str:
    """A path as printable text: bytes that are not UTF-8 (surrogate-escaped by Python)
    become ``\\udcXX`` escapes instead of failing the print."""
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


# ------------------------------------------------------------------ reading input files
def _exists(path: Path) -> bool:
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
                raise error(f"{where}: duplicate key {_clip(repr(k))}")
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
        raise error(f"{where}: JSON holds a number that cannot be read ({_clip(str(e))})") from None


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
    while not _exists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if _exists(ancestor) and not ancestor.is_dir():
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
