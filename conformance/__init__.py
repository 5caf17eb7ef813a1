"""refserve's conformance suite: check any engine's scheduler and KV manager against spec/.

An engine is driven in-process through an adapter (:mod:`refserve.conformance.adapter`) with a fake
model: the suite chooses every sampled token, so it can force stops, and it checks every
spec invariant after every step plus the leak check at quiescence. Entry points:
``refserve conformance --adapter MODULE:FACTORY`` (:mod:`refserve.conformance.cli`) and the pytest
plugin (:mod:`refserve.conformance.pytest_plugin`). The JSON report format is documented in
``conformance/REPORT_FORMAT.md``.

This module imports nothing heavy (no kernels, no triton, no torch, no hypothesis).
"""

REPORT_FORMAT_VERSION = 2

__all__ = ["REPORT_FORMAT_VERSION"]
