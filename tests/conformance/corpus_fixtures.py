"""Planted bugs for the corpus runner's own tests (refserve's engine, no third party)."""

from __future__ import annotations

import dataclasses

from refserve.conformance.adapter import RequestSpec
from refserve.conformance.adapters.ref import RefAdapter


class SaltBlind(RefAdapter):
    """Drops the cache salt and adapter before the engine sees them, as a cache key that
    leaves them out would; reports the tables as the engine keeps them."""

    def add_request(self, request: RequestSpec) -> None:
        super().add_request(dataclasses.replace(request, cache_salt="", lora=""))


def make_salt_blind() -> SaltBlind:
    return SaltBlind()


def make_broken() -> RefAdapter:
    raise RuntimeError("this factory is broken on purpose")
