"""The core: requests, the scheduler and its policies, the step plan, and the
transactional step (``engine_core``) that drives any executor. No torch, no files.

Layers (docs/ARCHITECTURE.md, "Layers"): ``refserve.errors``/``refserve.files`` < ``refserve.kv`` <
``refserve.core`` < ``refserve.model``, ``refserve.sim`` < ``refserve.engine`` < ``refserve.serve``
< ``refserve.report`` <
``refserve.cli``;
tests/repo/test_layers.py enforces the direction.
"""
