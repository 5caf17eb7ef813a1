"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeds, logprobs.

Randomness is per sequence and per output index, never shared: the generator that draws
output token ``k`` of a sequence is seeded from ``(seed, k)`` alone, so the same seed gives
the same tokens whatever else is in the batch, however prompts are chunked, and after a
recompute preemption. Sample ``i`` of an ``n > 1`` request uses :func:`derive_seed(seed, i)`
(sample 0 uses ``seed`` itself, so ``n=1`` and sample 0 of ``n=3`` agree).

Logprobs are of the model's distribution (raw logits, before temperature, top-k or
top-p), as vLLM reports by default.

Per-request isolation (docs/GUIDE.md, "The engine from Python"): parameters that cannot be sampled
are rejected when :class:`SamplingParams` is built (so at ``add_request``), and a row of
logits that cannot be sampled (a non-finite value, or a distribution that is not one
after temperature and the filters) is not an exception: :func:`sample` reports that one
sample as failed (:data:`FAILED_TOKEN` with a NaN logprob, see :func:`sample_failed`) and
the engine finishes only that request with the finish reason ``error``, after the step
committed for everyone. Raising here would roll the whole step back, and the same row
would fail the next step again: one request would stall every other one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from refserve.errors import InvalidArgument
from refserve.values import is_int, is_number

_MASK64 = (1 << 64) - 1

#: The smallest temperature accepted other than exactly 0 (greedy). Below it the scaled
#: logits ``logits / temperature`` head for the fp32 range (1e-45 turns every logit into
#: +-inf and the softmax into NaN), and the distribution is already greedy in all but
#: name for any realistic logit gap: ask for ``temperature=0``. vLLM's sampling epsilon.
MIN_TEMPERATURE = 1e-5

#: The token :func:`sample` reports for a row it could not sample. It is a valid id (the
#: scheduler commits it like any token, so the step stays one transaction) but it is not
#: the model's: the engine never shows it and finishes the request with ``error``.
FAILED_TOKEN = 0


class InvalidSamplingParams(InvalidArgument):
    """A sampling option is unknown or out of range; the message and ``field`` name it."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. ``temperature=0`` is greedy (the default).

    ``top_k`` 0 (or -1) and ``top_p`` 1 disable the filters. ``temperature`` is 0 or a
    finite number >= :data:`MIN_TEMPERATURE`; ``top_p`` is in (0, 1]; NaN and infinities
    are rejected everywhere. Each bad option raises :class:`InvalidSamplingParams` with
    ``field`` set to its name. ``stop`` strings end the
    output (cut before the stop string unless ``include_stop_str_in_output``);
    ``stop_token_ids`` and the model's eos end it with the token included in the ids.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _int_at_least("n", self.n, 1)
        _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("top_k", self.top_k, -1)
        t = self.temperature
        if (
            not is_number(t)
            or not (t == 0 or MIN_TEMPERATURE <= t < math.inf)  # also false for NaN
        ):
            raise InvalidSamplingParams(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                f"got {t!r}",
                field="temperature",
            )
        p = self.top_p
        if not is_number(p) or not 0 < p <= 1:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {p!r}", field="top_p")
        if self.seed is not None:
            _int_at_least("seed", self.seed, 0)
        stop: Any = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidSamplingParams(
                f"stop must be non-empty strings, got {self.stop!r}", field="stop"
            )
        object.__setattr__(self, "stop", tuple(stop))
        ids: Any = self.stop_token_ids
        if not isinstance(ids, list | tuple):
            raise InvalidSamplingParams(
                f"stop_token_ids must be a list of ints, got {ids!r}", field="stop_token_ids"
            )
        for i in ids:
            _int_at_least("stop_token_ids[]", i, 0)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        for name in ("ignore_eos", "logprobs", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(
                    f"{name} must be a bool, got {getattr(self, name)!r}", field=name
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, options: Mapping[str, object]) -> SamplingParams:
        """Build from a mapping; an unknown option is an error, not silently ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise InvalidSamplingParams(
                f"unknown sampling option(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(known))}",
                field=unknown[0],
            )
        return cls(**options)  # type: ignore[arg-type]


def _int_at_least(name: str, value: object, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise InvalidSamplingParams(
            f"{name} must be an int >= {minimum}, got {value!r}", field=name.removesuffix("[]")
        )


@dataclass(frozen=True)
class SampleSpec:
    """What the executor needs to sample one sequence."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logprobs: bool = False


def mix64(a: int, b: int) -> int:
    """A splitmix64-style mix of two ints into a 63-bit seed."""
    z = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def derive_seed(seed: int, sample_index: int) -> int:
    """Seed of sample ``sample_index`` of an ``n > 1`` request (sample 0 keeps ``seed``)."""
    return seed if sample_index == 0 else mix64(seed, 1_000_003 + sample_index)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude; ``logits`` is one fp32 row."""
    out = logits
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p (keeps at least one).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


#: What :func:`sample` returns for a row it cannot sample (see :func:`sample_failed`).
_FAILED: tuple[int, float | None] = (FAILED_TOKEN, math.nan)


def sample_failed(logprob: float | None) -> bool:
    """Whether :func:`sample` could not sample the row this logprob came with.

    A failed row is marked by a NaN logprob, which a sampled row never has (the
    log-softmax of finite logits is finite), so the mark passes unchanged through an
    executor that only forwards ``(token, logprob)`` pairs.
    """
    return logprob is not None and math.isnan(logprob)


def sample_row(
    logits: torch.Tensor, spec: SampleSpec, output_index: int
) -> tuple[int, float | None]:
    """Token (and its logprob if asked) for one sequence's fp32 logits row ``[V]``.

    A row with a non-finite logit, or whose distribution after temperature and the
    filters is not finite, gives ``(FAILED_TOKEN, nan)`` instead of raising (module doc).
    """
    if not bool(torch.isfinite(logits).all()):
        return _FAILED
    return _sample_finite_row(logits, spec, output_index)


def _sample_finite_row(
    logits: torch.Tensor, spec: SampleSpec, output_index: int
) -> tuple[int, float | None]:
    if spec.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        scaled = filter_logits(logits / spec.temperature, spec.top_k, spec.top_p)
        probs = torch.softmax(scaled, dim=-1)
        # Checked before drawing, not caught after: on CPU torch.multinomial raises on
        # inf/NaN, but on a GPU it may trip a device-side assert that ends the process.
        if not bool((torch.isfinite(probs).all() & (probs.sum() > 0)).item()):
            return _FAILED
        g = torch.Generator(device=logits.device).manual_seed(mix64(spec.seed, output_index))
        token = int(torch.multinomial(probs, 1, generator=g))
    logprob = float(torch.log_softmax(logits, dim=-1)[token]) if spec.logprobs else None
    return token, logprob


def sample(
    logits: torch.Tensor, specs: Sequence[SampleSpec], output_indices: Sequence[int]
) -> list[tuple[int, float | None]]:
    """One token per row of ``logits`` ``[N, V]`` (fp32). Greedy rows share one argmax.

    Rows are independent: a row that cannot be sampled gives ``(FAILED_TOKEN, nan)``
    (:func:`sample_failed`) and every other row is drawn exactly as without it.
    """
    if logits.shape[0] != len(specs) or len(specs) != len(output_indices):
        raise InvalidArgument("sample: logits rows, specs and output indices differ in number")
    if not logits.shape[0]:
        return []
    greedy = torch.argmax(logits, dim=-1).tolist()
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    out: list[tuple[int, float | None]] = []
    for i, spec in enumerate(specs):
        if not finite[i]:
            out.append(_FAILED)
        elif spec.temperature == 0 and not spec.logprobs:
            out.append((int(greedy[i]), None))
        else:
            out.append(_sample_finite_row(logits[i], spec, output_indices[i]))
    return out
