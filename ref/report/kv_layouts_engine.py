"""The real engine's part of ``refserve kv-layouts``: the same two layouts at one memory,
measured on :class:`~refserve.engine.llm_engine.LLMEngine` running a tiny hybrid model on
CPU, not on the simulator (the report: :mod:`refserve.report.kv_layouts_report`).

**The model.** A Qwen2 of ``num_layers`` layers, every other one a sliding window of
``window`` tokens (1:1), random weights seeded by ``seed``, its ``config.json`` embedded
here (:data:`HYBRID_QWEN2`) and read by :meth:`ModelConfig.from_hf` like a checkpoint's,
over the byte tokenizer. Nothing is downloaded.

**The layouts** (:attr:`EngineExperiment.layouts`), at the memory model of
docs/HYBRID_KV.md: ``dense`` is the same model on the plain pool of ``dense_blocks``
blocks (every block holds all layers; the sliding layers still read only their window);
``hybrid-1:1`` is ``grouped_kv=True`` with twice the blocks, each holding one group's
half of the layers, so the same bytes. The engine's own cache tensors are larger than the
memory model says (each layer keeps ``num_blocks`` blocks, docs/HYBRID_KV.md, "The model
executor"); :attr:`EngineRun.kv_bytes` records what they took.

**A run** (:func:`run_engine_capacity`: one layout, one prompt length): the same
:meth:`EngineExperiment.num_requests` requests, distinct seeded prompts of ``context``
tokens and ``output_len`` greedy output tokens (``ignore_eos``), are submitted at once;
the engine is stepped until all finish. Admission is the simulator's *reserve-peak*
(:class:`~refserve.sim.kv_layouts.ReservePeaks` with the ``first_chunk`` admission): a
request joins when the peaks of those running and its own fit the pool, so the memory
alone sets how many run. After every step :class:`~refserve.sim.kv_layouts.BlockProbe`
compares the pool's used blocks with the sum of ``layout_blocks`` over the running
requests. The capacity figures count, for each step, the requests it computed: every
request here has the same length and starts at once, so they finish in waves, and a
count taken after a step would see a wave's requests gone while the step's time was
spent on them. The wall time is the stepping loop's, on CPU with ``threads`` torch
threads.

:func:`measure_engine` runs every prompt length in both layouts and raises
:class:`OutputsDiffer` when the grouped pool changed a greedy token.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from refserve.core.config import Admission, SchedulerConfig
from refserve.errors import InvalidArgument, RefserveError
from refserve.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from refserve.sim.kv_layouts import (
    DENSE,
    BlockProbe,
    CapacityAdmission,
    KVLayout,
    LayoutExperiment,
    LoopFigures,
    ReservePeaks,
    StepSample,
    hybrid_layout,
)
from refserve.values import is_int

if TYPE_CHECKING:
    from refserve.core.engine_core import StepRecord
    from refserve.model.checkpoint import ModelSource

__all__ = [
    "HYBRID_QWEN2",
    "EngineExperiment",
    "EngineMeasured",
    "EnginePoint",
    "EngineRun",
    "OutputsDiffer",
    "build_model",
    "check_outputs",
    "measure_engine",
    "run_engine_capacity",
]

#: The model's ``config.json`` less what the experiment sets (the layers, the window, the
#: positions): a small Qwen2 with grouped-query attention over the byte tokenizer's ids.
HYBRID_QWEN2: dict[str, object] = {
    "model_type": "qwen2",
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "use_sliding_window": True,
}
#: The longest prompt the engine part takes: it runs on CPU in seconds, not minutes.
MAX_ENGINE_CONTEXT = 8192
#: The most requests one run submits.
MAX_ENGINE_REQUESTS = 2000
MAX_THREADS = 256
#: Passes of the stepping loop in a row without a step before the run is called stalled.
MAX_IDLE_PASSES = 3


class OutputsDiffer(RefserveError):
    """A request's greedy tokens differ between the layouts: the grouped pool changed
    what the model computed."""


@dataclass(frozen=True)
class EngineExperiment:
    """The engine part's sizes (module doc). ``capacity_budget``: the token budget of a
    step, large enough that prefill does not cap how many run; ``check_invariants``
    turns the engine's step checks on (the tests; it slows the wall time)."""

    contexts: tuple[int, ...] = (64, 128, 256, 512)
    output_len: int = 16
    block_size: int = 8
    window: int = 32
    num_layers: int = 4
    dense_blocks: int = 512
    capacity_budget: int = 1024
    threads: int = 1
    seed: int = 0
    check_invariants: bool = False
    # The simulator's settings record over the same sizes: the bounds, the peaks and the
    # scheduler's config come from it, so both sections count the same way.
    sizes: LayoutExperiment = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("output_len", "block_size", "window", "num_layers", "dense_blocks"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise InvalidArgument(f"engine {name} must be an int >= 1, got {value!r}")
        if self.num_layers % 2:
            raise InvalidArgument(
                f"engine num_layers must be even (half the layers slide), got {self.num_layers}"
            )
        if not is_int(self.threads) or not 1 <= self.threads <= MAX_THREADS:
            raise InvalidArgument(
                f"engine threads must be an int in [1, {MAX_THREADS}], got {self.threads!r}"
            )
        if not isinstance(self.check_invariants, bool):
            raise InvalidArgument(
                f"engine check_invariants must be True or False, got {self.check_invariants!r}"
            )
        if isinstance(self.contexts, tuple):
            for c in self.contexts:
                if is_int(c) and c > MAX_ENGINE_CONTEXT:
                    raise InvalidArgument(
                        f"engine contexts: {c} tokens; the engine part takes prompts of at "
                        f"most {MAX_ENGINE_CONTEXT} (it runs on CPU)"
                    )
        sizes = LayoutExperiment(
            (DENSE, hybrid_layout(1, self.window)),
            contexts=self.contexts,
            output_len=self.output_len,
            block_size=self.block_size,
            dense_blocks=self.dense_blocks,
            capacity_budget=self.capacity_budget,
            goodput_budget=self.capacity_budget,
            seed=self.seed,
        )
        object.__setattr__(self, "sizes", sizes)
        for c in self.contexts:
            if self.num_requests(c) > MAX_ENGINE_REQUESTS:
                raise InvalidArgument(
                    f"engine context {c} would submit {self.num_requests(c):,} requests; at "
                    f"most {MAX_ENGINE_REQUESTS:,} (lower dense_blocks)"
                )

    @property
    def layouts(self) -> tuple[KVLayout, ...]:
        """dense (the baseline) and hybrid-1:1 at ``window``."""
        return self.sizes.layouts

    def num_requests(self, context: int) -> int:
        """Requests one run submits at once: twice the most that any layout holds, so
        every layout's memory limits how many run."""
        return 2 * max(self.sizes.bound(x, context) for x in self.layouts)

    def model_config(self) -> ModelConfig:
        """:data:`HYBRID_QWEN2` with its layers (sliding, full, sliding, ...), window and
        positions, read as a checkpoint's ``config.json`` is."""
        kinds = [SLIDING_ATTENTION, FULL_ATTENTION] * (self.num_layers // 2)
        return ModelConfig.from_hf(
            {
                **HYBRID_QWEN2,
                "num_hidden_layers": self.num_layers,
                "sliding_window": self.window,
                "layer_types": kinds,
                "max_position_embeddings": max(self.contexts) + self.output_len,
            }
        )

    def config(self, layout: KVLayout) -> SchedulerConfig:
        """The scheduler of one run: the simulator's reserve-peak run's, ``layout`` in
        the experiment's memory, prefix caching off."""
        return self.sizes.config(layout, self.capacity_budget, Admission.FIRST_CHUNK)

    def prompts(self, context: int) -> list[list[int]]:
        """:meth:`num_requests` distinct seeded prompts of ``context`` byte ids."""
        rng = random.Random(f"kv-layouts-engine:{self.seed}:{context}")
        return [
            [rng.randrange(256) for _ in range(context)] for _ in range(self.num_requests(context))
        ]


@dataclass(frozen=True)
class EngineRun:
    """One layout at one prompt length on the engine: the capacity figures (as the
    simulator's reserve-peak run has them, its times the engine's wall clock, a step's
    running count the requests it computed), every step's probe sample (the pool after
    the step), each request's greedy tokens in submission order, the stepping loop's
    wall time and the bytes the engine's cache tensors took."""

    layout: str
    context: int
    figures: LoopFigures
    samples: tuple[StepSample, ...]
    outputs: tuple[tuple[int, ...], ...]
    wall_s: float
    output_tokens: int
    kv_bytes: int
    grouped: bool  # the engine kept a table per layer group (its pool a GroupedPool)


def build_model(exp: EngineExperiment) -> ModelSource:
    """The model with its seeded random weights, built once for every run."""
    from refserve.model.weights import random_weights

    cfg = exp.model_config()
    return cfg, random_weights(cfg, exp.seed)


def run_engine_capacity(
    exp: EngineExperiment, layout: KVLayout, context: int, model: ModelSource
) -> EngineRun:
    """Submit :meth:`EngineExperiment.prompts` at once and step to the end (module doc)."""
    from refserve.engine.driving import EngineStalled
    from refserve.engine.llm_engine import LLMEngine
    from refserve.model.sampler import SamplingParams

    if layout not in exp.layouts:
        raise InvalidArgument(f"layout {layout.name!r} is not one of the engine part's")
    if context not in exp.contexts:
        raise InvalidArgument(f"context {context!r} is not one of the engine part's")
    config = exp.config(layout)
    engine = LLMEngine(
        model,
        tokenizer="byte",
        scheduler_config=config,
        policy=ReservePeaks(layout, config.num_blocks, config.block_size),
        grouped_kv=bool(layout.kv_groups),
        check_invariants=exp.check_invariants,
    )
    probe = BlockProbe(engine.scheduler, layout)
    params = SamplingParams(max_tokens=exp.output_len, ignore_eos=True)
    ids = [
        engine.add_request(p, params, request_id=f"c{context}-{i}")
        for i, p in enumerate(exp.prompts(context))
    ]
    tokens: dict[str, tuple[int, ...]] = {}
    batches: list[StepSample] = []
    seen = idle = 0
    started = time.perf_counter()
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = tuple(out.token_ids)
        records = engine.steps
        # One engine step is one scheduler step: the probe reads the state it left.
        for record in records[seen:]:
            probe(record)
            batches.append(_batch(probe.samples[-1], record))
        idle = idle + 1 if len(records) == seen else 0
        seen = len(records)
        if idle > MAX_IDLE_PASSES:
            raise EngineStalled(f"{layout.name} at {context}: the engine stopped stepping")
    wall_s = time.perf_counter() - started
    outputs = tuple(tokens[rid] for rid in ids)
    return EngineRun(
        layout=layout.name,
        context=context,
        figures=LoopFigures.of(
            CapacityAdmission.RESERVE_PEAK, batches, config.num_blocks, engine.num_preemptions
        ),
        samples=tuple(probe.samples),
        outputs=outputs,
        wall_s=wall_s,
        output_tokens=sum(len(t) for t in outputs),
        kv_bytes=engine.cache.nbytes,
        grouped=engine.scheduler.config.grouped,
    )


def _batch(sample: StepSample, record: StepRecord) -> StepSample:
    """The probe's sample with the requests the step computed as its running and
    decoding counts: those are what the step's wall time was spent on (the probe counts
    them after the step, when those that finished are gone)."""
    plan = record.plan
    return dataclasses.replace(
        sample, running=len(plan.request_ids), decoding=plan.num_decode_requests
    )


@dataclass(frozen=True)
class EnginePoint:
    """One layout at one prompt length: the analytic bound (as the simulator section
    computes it) beside what the engine ran, and its wall-clock output rate on CPU."""

    layout: str
    context: int
    num_blocks: int
    num_requests: int
    peak_blocks: int
    bound: int
    chunk_peak_blocks: int
    chunk_bound: int
    reserve_peak: LoopFigures
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    kv_bytes: int
    grouped: bool
    throughput_ratio: float | None  # to the baseline's output tokens/s at this context


@dataclass(frozen=True)
class EngineMeasured:
    """Every engine run's point, and the greedy outputs compared between the layouts."""

    points: tuple[EnginePoint, ...]
    requests_compared: int
    torch_threads: int


def measure_engine(exp: EngineExperiment, stream: TextIO | None = None) -> EngineMeasured:
    """Every prompt length in both layouts; :class:`OutputsDiffer` when a request's
    greedy tokens are not the same in both."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(exp.threads)
    try:
        model = build_model(exp)
        points: list[EnginePoint] = []
        compared = 0
        for context in exp.contexts:
            runs = [run_engine_capacity(exp, x, context, model) for x in exp.layouts]
            compared += check_outputs(runs)
            points += _points(exp, runs)
            if stream is not None:
                for p in points[-len(runs) :]:
                    print(
                        f"  engine {context:>6} tokens {p.layout:<12} bound {p.bound:>4} ran "
                        f"{p.reserve_peak.max_running:>4}  {p.output_tokens_per_s:8.0f} "
                        f"output tok/s ({p.wall_s:.1f} s CPU)",
                        file=stream,
                        flush=True,
                    )
    finally:
        torch.set_num_threads(threads)
    return EngineMeasured(tuple(points), compared, exp.threads)


def check_outputs(runs: Sequence[EngineRun]) -> int:
    """The requests compared between runs of one prompt length; :class:`OutputsDiffer`
    when a layout's tokens differ from the first layout's."""
    base = runs[0]
    for run in runs[1:]:
        for i, (want, got) in enumerate(zip(base.outputs, run.outputs, strict=True)):
            if want != got:
                raise OutputsDiffer(
                    f"request {i} of context {run.context}: {run.layout} gave {list(got)}, "
                    f"{base.layout} {list(want)}"
                )
    return len(base.outputs)


def _points(exp: EngineExperiment, runs: Sequence[EngineRun]) -> list[EnginePoint]:
    by_name = {x.name: x for x in exp.layouts}
    rates = [r.output_tokens / r.wall_s if r.wall_s > 0 else 0.0 for r in runs]
    base = rates[0]
    points = []
    for run, rate in zip(runs, rates, strict=True):
        layout, c = by_name[run.layout], run.context
        points.append(
            EnginePoint(
                layout=run.layout,
                context=c,
                num_blocks=layout.num_blocks(exp.dense_blocks),
                num_requests=exp.num_requests(c),
                peak_blocks=layout.peak(c + exp.output_len, exp.block_size),
                bound=exp.sizes.bound(layout, c),
                chunk_peak_blocks=exp.sizes.chunk_peak(layout, c),
                chunk_bound=exp.sizes.chunk_bound(layout, c),
                reserve_peak=run.figures,
                wall_s=run.wall_s,
                output_tokens=run.output_tokens,
                output_tokens_per_s=rate,
                kv_bytes=run.kv_bytes,
                grouped=run.grouped,
                throughput_ratio=rate / base if base > 0 else None,
            )
        )
    return points
