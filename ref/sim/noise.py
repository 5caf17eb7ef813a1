"""Step-to-step variation of the simulated step time (``bench-serve --fit``).

A real step's time scatters around what the cost model says: other processes on the
machine, the GIL shared with the HTTP side, allocator and cache effects. A simulator
that gives every step its modelled mean time has every gap between two tokens at that
mean, so its TBT P90 and P99 come out far below a real server's, and a request that
arrives behind one slow step is not delayed. :class:`StepNoise` multiplies each step's
modelled time by a factor drawn, seeded, from an empirical sample (the fit's measured
step times over its model's, ref/serve/fit.py): a replay stays deterministic. A step
with prefill draws from ``prefill_factors`` when there are some (its scatter is not a
decode step's: more of it is arithmetic, less of it the loop's Python), else from
``factors``. With ``gaps_ms``, the serving loop's time after each step (the cost's
``g``) is drawn from them too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from refserve.errors import InvalidArgument
from refserve.values import is_number

#: The most factors a noise model holds (a fit keeps quantiles, not every step).
MAX_FACTORS = 10_000


@dataclass(frozen=True)
class StepNoise:
    """Each step's modelled time times a factor drawn from ``factors`` (module doc)."""

    factors: tuple[float, ...]
    seed: int = 0
    prefill_factors: tuple[float, ...] = ()
    gaps_ms: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name, f, least in (
            ("factors", self.factors, 1),
            ("prefill_factors", self.prefill_factors, 0),
        ):
            if not least <= len(f) <= MAX_FACTORS:
                raise InvalidArgument(
                    f"StepNoise needs {least} to {MAX_FACTORS} {name}, got {len(f)}"
                )
            for x in f:
                if not is_number(x) or not 0 < x < math.inf:
                    raise InvalidArgument(f"a step-noise factor must be a number > 0, got {x!r}")
        if len(self.gaps_ms) > MAX_FACTORS:
            raise InvalidArgument(f"StepNoise holds at most {MAX_FACTORS} gaps")
        for x in self.gaps_ms:
            if not is_number(x) or not 0 <= x < math.inf:
                raise InvalidArgument(f"a loop gap must be a number >= 0 ms, got {x!r}")

    @property
    def mean(self) -> float:
        return sum(self.factors) / len(self.factors)

    def sampler(self, stream: str) -> Callable[[bool], float]:
        """A seeded draw of factors (the argument: the step has prefill); each ``stream``
        (a replica) draws its own sequence."""
        rng = random.Random(f"step-noise:{self.seed}:{stream}")
        decode, prefill = self.factors, self.prefill_factors or self.factors

        def draw(has_prefill: bool) -> float:
            pool = prefill if has_prefill else decode
            return pool[rng.randrange(len(pool))]

        return draw

    def gap_sampler(self, stream: str) -> Callable[[], float] | None:
        """A seeded draw of the loop's gaps after a step (None: there are none)."""
        if not self.gaps_ms:
            return None
        rng = random.Random(f"step-gap:{self.seed}:{stream}")
        gaps = self.gaps_ms
        return lambda: gaps[rng.randrange(len(gaps))]
