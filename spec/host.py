"""BLOCK and POS for the host-side swap pool: swapped KV lives in exactly one place.

Why it matters: preemption by swap (docs/ARCHITECTURE.md, "Where refserve differs from
vLLM") copies a victim's KV to host memory
and back. A host block handed to two swapped requests, or freed while its request is
still swapped, is silent corruption after swap-in, just as on the device; a request
holding KV in both pools (a swap-out that forgot to free the device blocks, a swap-in
that forgot the host ones) leaks one of them; a SWAPPED request without a host table
resumes with positions whose K/V exist nowhere.

The host pool is checked with the device pool's own BLOCK and POS predicates (its
subjects are prefixed with ``host``), plus the cross-pool rules here.
"""

from __future__ import annotations

from dataclasses import replace

from refserve.spec.block import check_block
from refserve.spec.pos import check_pos_pool
from refserve.spec.snapshot import EngineSnapshot, RequestSnapshot, RequestStatus
from refserve.spec.violation import Invariant, Violation, violation

B = Invariant.BLOCK
P = Invariant.POS
# States in which a request may keep its KV on the host.
_HOST_STATES = (RequestStatus.SWAPPED, RequestStatus.WAITING_TOOL)


def check_host(engine: EngineSnapshot, lookahead: int = 0) -> list[Violation]:
    """The host pool's own BLOCK/POS rules and where each request's KV lives
    (``lookahead``: blocks reserved ahead travel with a swapped table)."""
    host = engine.host
    out: list[Violation] = []
    if host is None:
        for r in engine.requests:
            if _needs_host(r, engine, set()):
                out.append(_nowhere(r.request_id, r.status, r.num_computed_tokens))
        return out
    out.extend(
        replace(v, subject=f"host {v.subject}")
        for v in (*check_block(host), *check_pos_pool(host, lookahead))
    )
    for b, rc in enumerate(host.ref_cnt):
        if rc > 1:
            out.append(violation(B, f"host block {b}", "swapped KV is shared", "<= 1", rc))
    if host.cache_entries:
        out.append(
            violation(
                B,
                "host pool",
                "host blocks are in a prefix-cache index",
                0,
                len(host.cache_entries),
            )
        )
    requests = {r.request_id: r for r in engine.requests}
    host_ids: set[str] = set()
    for t in host.tables:
        rid = t.request_id
        host_ids.add(rid)
        who = f"request {rid}"
        owner = requests.get(rid)
        if owner is None or owner.status not in _HOST_STATES:
            state = "unknown" if owner is None else owner.status.value
            out.append(
                violation(
                    B,
                    who,
                    "holds host blocks but is not swapped or waiting for a tool",
                    "swapped | waiting_tool",
                    state,
                )
            )
            continue
        if engine.pool.table(rid) is not None:
            out.append(violation(B, who, "holds KV in both the device and the host pool", 1, 2))
        if t.num_stored != owner.num_computed_tokens:
            out.append(
                violation(
                    P,
                    who,
                    "host KV length differs from num_computed_tokens",
                    owner.num_computed_tokens,
                    t.num_stored,
                )
            )
    for r in engine.requests:
        if _needs_host(r, engine, host_ids):
            out.append(_nowhere(r.request_id, r.status, r.num_computed_tokens))
    return out


def _needs_host(r: RequestSnapshot, engine: EngineSnapshot, host_ids: set[str]) -> bool:
    """A swapped request, or a paused one with KV, whose KV is in neither pool."""
    if r.request_id in host_ids:
        return False
    if r.status is RequestStatus.SWAPPED:
        return True
    return (
        r.status is RequestStatus.WAITING_TOOL
        and r.num_computed_tokens > 0
        and engine.pool.table(r.request_id) is None
    )


def _nowhere(request_id: str, status: RequestStatus, num_computed: int) -> Violation:
    return violation(
        P,
        f"request {request_id}",
        f"{status.value} request's KV is in neither pool",
        f"{num_computed} tokens",
        "no table",
    )
