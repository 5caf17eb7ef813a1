"""Which replica holds each live request: the cluster's ownership map (docs/CLUSTER.md,
"Ownership").

The rule (:meth:`Ownership.violations`): every request live on a replica is live on
that one alone and mapped to it, and the map holds nothing else. The cluster keeps the
map (a route adds, a migration moves, an abort, a final output or a death removes);
this module owns it and states the rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from refserve.errors import UnknownRequest


class Ownership:
    """Live request -> the replica that holds it (module doc)."""

    def __init__(self) -> None:
        self._replica_of: dict[str, int] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._replica_of

    def __setitem__(self, request_id: str, replica: int) -> None:
        """``request_id`` is now held by ``replica`` (routed there, or moved there)."""
        self._replica_of[request_id] = replica

    def get(self, request_id: str) -> int | None:
        return self._replica_of.get(request_id)

    def owner(self, request_id: str) -> int:
        """The replica holding ``request_id``; ``UnknownRequest`` if none does."""
        r = self._replica_of.get(request_id)
        if r is None:
            raise UnknownRequest(request_id, "owner")
        return r

    def copy(self) -> dict[str, int]:
        """A copy of the map."""
        return dict(self._replica_of)

    def forget(self, request_id: str) -> None:
        """``request_id`` ended: it leaves the map."""
        del self._replica_of[request_id]

    def held_by(self, replica: int) -> list[str]:
        """The requests mapped to ``replica``."""
        return [rid for rid, r in self._replica_of.items() if r == replica]

    def violations(self, live: Iterable[tuple[int, Sequence[str]]]) -> list[str]:
        """The rule (module doc) against ``live``, each live replica with the requests
        live on it; empty when it holds."""
        out: list[str] = []
        seen: dict[str, int] = {}
        for r, request_ids in live:
            for rid in request_ids:
                if rid in seen:
                    out.append(f"{rid!r} is live on replicas {seen[rid]} and {r}")
                seen.setdefault(rid, r)
                mapped = self._replica_of.get(rid)
                if mapped != r:
                    out.append(f"{rid!r} is live on replica {r}, mapped to {mapped}")
        for rid, r in self._replica_of.items():
            if rid not in seen:
                out.append(f"{rid!r} is mapped to replica {r}, live on none")
        return out
