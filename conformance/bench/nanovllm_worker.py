"""nano-vllm-fork's side of ``make bench-peers`` (runs in ``.venv-nanovllm``).

The engine is built as the conformance adapter builds it
(``refserve.conformance.adapters.nanovllm``: its ``Scheduler`` and ``BlockManager`` from a
hand-made config, a ``Sequence`` subclass carrying block size 16). The timed step is
``Scheduler.schedule()`` + ``ModelRunner.prepare_decode()`` + ``Scheduler.postprocess()``.

``prepare_decode`` (with ``prepare_block_tables``, which it calls) is nano-vllm's own
source, compiled from the installed ``nanovllm/engine/model_runner.py``: the model
runner's module cannot be imported without ``flash_attn`` and a GPU. It fills the
runner's pre-allocated host buffers element by element and builds the block-table
tensor, as on a GPU machine; only the host-to-device copies (``.cuda(non_blocking=
True)``) and the pinned allocation (``pin_memory=True``) are no-ops here, as there is
no device. The timed step therefore includes nano-vllm's input preparation on the host
and excludes the copies.
"""

from __future__ import annotations

import ast
import importlib
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from refserve.conformance.adapter import EngineConfig, RequestSpec
from refserve.conformance.bench import workload as W
from refserve.conformance.bench.worker import Unsupported, serve


class _HostTorch:
    """``torch`` for the runner's code on a host without a device: ``pin_memory`` dropped."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch

    def tensor(self, data: Any, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return self._torch.tensor(data, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def _runner_functions(torch: Any) -> dict[str, Any]:
    """``ModelRunner.prepare_decode`` and ``prepare_block_tables``, compiled from the
    installed source (unchanged) in a namespace with the names they use."""
    pkg = sys.modules["nanovllm"]
    path = Path(next(iter(pkg.__path__))) / "engine" / "model_runner.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
    wanted = {"prepare_decode", "prepare_block_tables"}
    funcs: list[ast.stmt] = [
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted
    ]
    if {f.name for f in funcs if isinstance(f, ast.FunctionDef)} != wanted:
        raise RuntimeError(f"{path} has no ModelRunner.{' / '.join(sorted(wanted))}")
    context = importlib.import_module("nanovllm.utils.context")
    namespace: dict[str, Any] = {
        "torch": _HostTorch(torch),
        "set_context": context.set_context,
        "Sequence": importlib.import_module("nanovllm.engine.sequence").Sequence,
    }
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in wanted}


class NanoVllmBench:
    phases = ("schedule", "prepare_decode", "postprocess")
    includes = (
        "Scheduler.schedule() + ModelRunner.prepare_decode() (nano-vllm's own source: host "
        "buffers filled element by element, block-table tensor; the .cuda() copies are "
        "no-ops without a GPU) + Scheduler.postprocess()"
    )

    def __init__(self) -> None:
        from refserve.conformance.adapters import nanovllm as adapter_module

        self._adapter_module: Any = adapter_module
        self._torch: Any = importlib.import_module("torch")
        # No device: the runner's host-to-device copies become no-ops (this process only).
        self._torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        self._fns = _runner_functions(self._torch)

    @property
    def name(self) -> str:
        return str(self._adapter_module.NanoVllmAdapter().name)

    def setup(self, shape: W.Shape) -> object:
        if not shape.prefix_caching:
            raise Unsupported("nano-vllm always caches prefixes (no switch)")
        adapter = self._adapter_module.NanoVllmAdapter()
        adapter.configure(
            EngineConfig(
                block_size=W.BLOCK_SIZE,
                num_blocks=shape.num_blocks,
                max_num_batched_tokens=shape.max_num_batched_tokens,
                max_num_seqs=shape.max_num_seqs,
                enable_prefix_caching=True,
            )
        )
        for i in range(shape.n):
            adapter.add_request(RequestSpec(W.request_id(i), tuple(W.prompt(i)), W.MAX_TOKENS))
        sched = adapter.scheduler
        while sched.waiting or any(s.num_completion_tokens == 0 for s in sched.running):
            seqs, _ = sched.schedule()
            sched.postprocess(seqs, [W.PREFILL_TOKEN] * len(seqs))
        if len(sched.running) != shape.n:
            raise RuntimeError(f"{len(sched.running)} of {shape.n} running after prefill")
        torch = self._torch
        runner = SimpleNamespace(
            block_size=W.BLOCK_SIZE,
            _cpu_input_ids=torch.zeros(shape.n, dtype=torch.int64),
            _cpu_positions=torch.zeros(shape.n, dtype=torch.int64),
            _cpu_slot_mapping=torch.zeros(shape.n, dtype=torch.int32),
            _cpu_context_lens=torch.zeros(shape.n, dtype=torch.int32),
        )
        runner.prepare_block_tables = types.MethodType(self._fns["prepare_block_tables"], runner)
        return (sched, runner)

    def step(self, state: object) -> tuple[int, ...]:
        pair: tuple[Any, Any] = state  # type: ignore[assignment]  # built by setup()
        sched, runner = pair
        prepare_decode = self._fns["prepare_decode"]
        t0 = time.perf_counter_ns()
        seqs, is_prefill = sched.schedule()
        t1 = time.perf_counter_ns()
        prepare_decode(runner, seqs)
        t2 = time.perf_counter_ns()
        token_ids = [W.SAMPLED] * len(seqs)  # the model's output
        t3 = time.perf_counter_ns()
        sched.postprocess(seqs, token_ids)
        t4 = time.perf_counter_ns()
        if is_prefill or len(seqs) != len(sched.running):
            raise RuntimeError(f"not a decode step of every request ({len(seqs)} scheduled)")
        return (t1 - t0, t2 - t1, t4 - t3)


if __name__ == "__main__":
    raise SystemExit(serve(NanoVllmBench))
