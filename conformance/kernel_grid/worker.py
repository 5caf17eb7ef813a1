"""The isolated worker (docs/KERNELS.md, "Running the grid"): ``refserve check-kernel``
runs each (case, dtype) in a persistent subprocess (``python -m refserve.conformance.kernel_grid
TARGET --worker``), restarted after a crash or a timeout, so a kernel that segfaults or
hangs fails that case and the run goes on.

Protocol (one JSON object per line): the parent writes {"case", "dtype"}; the worker
answers first {"event": "ready", "capabilities"} or {"event": "load_error", "error"},
then one CaseResult record per request. The worker's fd 1 is pointed at its stderr, so
a kernel that prints cannot corrupt the protocol, which uses a private dup of stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import IO, Any

import torch

from refserve.conformance.kernel_grid.capabilities import (
    GridHarnessError,
    KernelCapabilities,
    capabilities_of,
)
from refserve.conformance.kernel_grid.cases import CASES, GridCase
from refserve.conformance.kernel_grid.results import (
    EXIT_PASSED,
    EXIT_USAGE,
    FAIL,
    TIMEOUT,
    CaseResult,
)
from refserve.conformance.kernel_grid.run import run_case
from refserve.kernels.tolerances import Tolerance, attention_tolerance

#: The dtypes a run may ask for, by name (``--dtype`` and the protocol's ``dtype``).
DTYPES = MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)


def load_function(target: str) -> Callable[..., torch.Tensor]:
    """The callable ``target`` names (``MODULE:FUNCTION``, attribute paths allowed);
    ``ValueError`` when it is malformed or not callable."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FUNCTION, got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{target} is not callable")
    fn: Callable[..., torch.Tensor] = obj
    return fn


def worker_main(args: argparse.Namespace) -> int:
    """The worker's side of the protocol: load the target, say ready, then answer one
    result per request until stdin closes."""
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    faulthandler.enable()  # a segfaulting kernel leaves its Python stack in the report
    try:
        fn = load_function(args.target)
        caps = capabilities_of(fn)
    except Exception as exc:  # anything the target's import raises is a harness error
        proto.write(json.dumps({"event": "load_error", "error": f"{type(exc).__name__}: "
                                f"{exc}"}) + "\n")  # fmt: skip
        return EXIT_USAGE
    proto.write(json.dumps({"event": "ready", "capabilities": caps.to_json()}) + "\n")
    tol = tolerance_override(args.atol, args.rtol)
    device = torch.device(args.device)
    for line in sys.stdin:
        req = json.loads(line)
        dtype = DTYPES[req["dtype"]]
        result = run_case(
            fn, CASES[req["case"]], dtype, device, seed=args.seed,
            tolerance=tol(dtype, device), capabilities=caps, with_traceback=args.traceback,
        )  # fmt: skip
        proto.write(json.dumps(result.to_json()) + "\n")
    return EXIT_PASSED


def tolerance_override(
    atol: float | None, rtol: float | None
) -> Callable[[torch.dtype, torch.device], Tolerance | None]:
    """Per-dtype tolerance with ``--atol``/``--rtol`` replacing the part they name."""

    def pick(dtype: torch.dtype, device: torch.device) -> Tolerance | None:
        if atol is None and rtol is None:
            return None
        base = attention_tolerance(dtype, device)
        return Tolerance(
            atol=base.atol if atol is None else atol, rtol=base.rtol if rtol is None else rtol
        )

    return pick


class Worker:
    """One persistent worker subprocess, restarted after a crash or a timeout."""

    READY_TIMEOUT_S = 600.0  # importing torch + triton + the kernel, on a loaded machine

    def __init__(self, argv: list[str], env: Mapping[str, str]) -> None:
        self._argv = argv
        self._env = dict(env)
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._stderr: IO[bytes] | None = None
        self.capabilities: KernelCapabilities | None = None

    def _start(self) -> None:
        # Closed in stop(): it outlives this method (the crash report reads its tail).
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self._buf = b""
        self._proc = subprocess.Popen(
            self._argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env,
            start_new_session=True,  # its own group: a timeout kills its children too
        )
        line = self._read_line(self.READY_TIMEOUT_S)
        msg = json.loads(line) if line else None
        if not msg or msg.get("event") != "ready":
            detail = msg.get("error") if msg else self._describe_exit()
            self.stop()
            raise GridHarnessError(f"worker did not start: {detail}")
        self.capabilities = KernelCapabilities.from_declared(
            {k: v for k, v in msg["capabilities"].items()}
        )

    def ensure_started(self) -> KernelCapabilities:
        if self._proc is None:
            self._start()
        assert self.capabilities is not None
        return self.capabilities

    def _read_line(self, timeout: float) -> bytes | None:
        """The next protocol line, or None on EOF (the worker died) or after ``timeout``."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _stderr_tail(self, limit: int = 3000) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        text = self._stderr.read().decode("utf-8", "replace")
        return text[-limit:]

    def _describe_exit(self) -> str:
        assert self._proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        code = self._proc.returncode
        if code is None:
            how = "stopped answering"
        elif code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        tail = self._stderr_tail()
        return how + (f"; stderr tail:\n{tail}" if tail.strip() else "")

    def stop(self) -> None:
        """Kill the worker's process group (ours: started with a new session) and reap it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def run(self, case: GridCase, dtype: str, timeout: float, base: CaseResult) -> CaseResult:
        """Run one case; a crash is FAIL and a hang TIMEOUT, and the worker is restarted."""
        self.ensure_started()
        assert self._proc is not None and self._proc.stdin is not None
        started = time.perf_counter()
        try:
            self._proc.stdin.write((json.dumps({"case": case.name, "dtype": dtype}) + "\n")
                                   .encode())  # fmt: skip
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died between cases; the read below reports how
        line = self._read_line(timeout)
        elapsed = round(time.perf_counter() - started, 4)
        if line is not None:
            return CaseResult.from_json(json.loads(line))
        if self._proc.poll() is None and self._proc_alive_after_timeout():
            self.stop()
            return replace(base, status=TIMEOUT, time_s=elapsed,
                           error=f"no result after {timeout:g}s; worker killed")  # fmt: skip
        detail = self._describe_exit()
        self.stop()
        return replace(base, status=FAIL, time_s=elapsed, error=f"worker crashed: {detail}")

    def _proc_alive_after_timeout(self) -> bool:
        # EOF and a timeout both return None; a live process means it was the timeout.
        assert self._proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=0.5)
        return self._proc.returncode is None


def worker_argv(args: argparse.Namespace, device: torch.device) -> list[str]:
    argv = [sys.executable, "-m", "refserve.conformance.kernel_grid", args.target, "--worker",
            "--device", str(device), "--seed", str(args.seed)]  # fmt: skip
    if args.atol is not None:
        argv += ["--atol", repr(args.atol)]
    if args.rtol is not None:
        argv += ["--rtol", repr(args.rtol)]
    if args.traceback:
        argv.append("--traceback")
    return argv
