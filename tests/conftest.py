"""Hypothesis profiles: ``ci`` (deterministic, no explain phase), ``dev``, ``deep``.

CI sets CI=true, for which Hypothesis itself loads a built-in ``ci`` profile; we register
our own on top so the example counts and phases are ours. ``HYPOTHESIS_PROFILE=deep``
runs long local searches (``make deep``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The checkout's folders keep generic names (kernels/, spec/), and `python -m pytest` puts
# the working directory first on sys.path, where kernels/ would hide Hugging Face's
# `kernels` distribution from transformers (which imports it). refserve itself is imported
# under its one name (docs/ARCHITECTURE.md, "One import name"); the checkout root stays on
# the path only for `tests.*`, last, so an installed distribution always wins over a folder.
_CHECKOUT = Path(__file__).resolve().parents[1]


def _is_checkout(entry: str) -> bool:
    return Path(entry or ".").resolve() == _CHECKOUT


if any(_is_checkout(entry) for entry in sys.path):
    sys.path[:] = [entry for entry in sys.path if not _is_checkout(entry)] + [str(_CHECKOUT)]

import tests  # noqa: E402

# Last on the path, `tests` would lose to a distribution that ships a top-level `tests`.
assert Path(next(iter(tests.__path__))).resolve() == _CHECKOUT / "tests", (
    f"`tests` is imported from {list(tests.__path__)}: an installed distribution ships a "
    "top-level `tests` package, which hides this checkout's"
)

import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# Triton has no CPU backend: without CUDA its kernels run in the interpreter on CPU
# tensors. ``@triton.jit`` reads this when a kernel module is imported, so it is set here,
# before any test module (kernels' or the engine's triton backend) imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under `make pytest` each core runs its own worker (pytest-xdist): torch's intra-op
# threads would then oversubscribe the cores, each worker's matmuls fighting the other's.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

_CI_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    phases=_CI_PHASES,  # the explain phase took 135 s of a 155 s failing run
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, phases=_CI_PHASES)
settings.register_profile(
    "deep",
    deadline=None,
    max_examples=2000,
    stateful_step_count=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
