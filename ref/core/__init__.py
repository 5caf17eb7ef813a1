"""The core: requests, the scheduler and its policies, the step plan, and the
transactional step (``engine_core``) that drives any executor. No torch, no files.

Layers (docs/ARCHITECTURE.md, "Layers"): ``ref.errors``/``ref.files`` < ``ref.kv`` <
``ref.core`` < ``ref.model``, ``ref.sim`` < ``ref.engine`` < ``ref.serve`` < ``ref.report`` <
``ref.cli``;
tests/repo/test_layers.py enforces the direction.
"""
