"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeds, logprobs.

Randomness is per sequence and per output index, never shared: the generator that draws
output token ``k`` of a sequence is seeded from ``(seed, k)`` alone, so the same seed gives
the same tokens whatever else is in the batch, however prompts are chunked, and after a
recompute preemption. Sample ``i`` of an ``n > 1`` request uses :func:`derive_seed(seed, i)`
(sample 0 uses ``seed`` itself, so ``n=1`` and sample 0 of ``n=3`` agree).

Logprobs are of the model's distribution (raw logits, before temperature, top-k or
top-p), as vLLM reports by default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from ref.errors import InvalidArgument

_MASK64 = (1 << 64) - 1


class InvalidSamplingParams(InvalidArgument):
    """A sampling option is unknown or out of range; the message names it."""


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. ``temperature=0`` is greedy (the default).

    ``top_k`` 0 (or -1) and ``top_p`` 1 disable the filters. ``stop`` strings end the
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
        if isinstance(t, bool) or not isinstance(t, int | float) or not t >= 0 or t == float("inf"):
            raise InvalidSamplingParams(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None:
            _int_at_least("seed", self.seed, 0)
        stop: Any = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidSamplingParams(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids: Any = self.stop_token_ids
        if not isinstance(ids, list | tuple):
            raise InvalidSamplingParams(f"stop_token_ids must be a list of ints, got {ids!r}")
        for i in ids:
            _int_at_least("stop_token_ids[]", i, 0)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        for name in ("ignore_eos", "logprobs", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(f"{name} must be a bool, got {getattr(self, name)!r}")

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
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**options)  # type: ignore[arg-type]


def _int_at_least(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidSamplingParams(f"{name} must be an int >= {minimum}, got {value!r}")


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


def sample_row(
    logits: torch.Tensor, spec: SampleSpec, output_index: int
) -> tuple[int, float | None]:
    """Token (and its logprob if asked) for one sequence's fp32 logits row ``[V]``."""
    if spec.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        scaled = filter_logits(logits / spec.temperature, spec.top_k, spec.top_p)
        probs = torch.softmax(scaled, dim=-1)
        g = torch.Generator(device=logits.device).manual_seed(mix64(spec.seed, output_index))
        token = int(torch.multinomial(probs, 1, generator=g))
    logprob = float(torch.log_softmax(logits, dim=-1)[token]) if spec.logprobs else None
    return token, logprob


def sample(
    logits: torch.Tensor, specs: Sequence[SampleSpec], output_indices: Sequence[int]
) -> list[tuple[int, float | None]]:
    """One token per row of ``logits`` ``[N, V]`` (fp32). Greedy rows share one argmax."""
    if logits.shape[0] != len(specs) or len(specs) != len(output_indices):
        raise InvalidArgument("sample: logits rows, specs and output indices differ in number")
    greedy = torch.argmax(logits, dim=-1).tolist() if logits.shape[0] else []
    out: list[tuple[int, float | None]] = []
    for i, spec in enumerate(specs):
        if spec.temperature == 0 and not spec.logprobs:
            out.append((int(greedy[i]), None))
        else:
            out.append(sample_row(logits[i], spec, output_indices[i]))
    return out
