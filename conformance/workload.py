"""A workload: the engine limits, the requests, when they arrive, abort and stop.

Workloads are plain data and round-trip through JSON, so a failure's shrunk workload can
be replayed with ``refserve conformance --adapter ... --replay workload.json``. The suite
plays a deterministic greedy model: the token sampled after a sequence depends only on
that sequence (:func:`next_token`), so identical prompts produce identical outputs, as
with greedy decoding, and a replay samples exactly the same tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

from refserve.conformance.adapter import EngineConfig, Feature, RequestSpec, TransferOutcome
from refserve.spec.snapshot import TransferKind

EOS = 1
"""The eos token id of every workload; :func:`next_token` never returns it by chance."""
VOCAB = 64


@dataclass(frozen=True)
class RequestPlan:
    """One request of a workload.

    ``stop_at``: the suite samples eos as output number ``stop_at`` (1-based), forcing a
    stop (an engine declared without eos handling must run on past it); ``abort_at``:
    the suite aborts it at that step boundary if it is still live.
    """

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int = 0
    priority: int = 0
    stop_at: int | None = None
    abort_at: int | None = None
    cache_salt: str = ""
    lora: str = ""

    @property
    def domain(self) -> str:
        """The key domain the request's K/V belongs to (``""``: the default one)."""
        if not (self.cache_salt or self.lora):
            return ""
        return f"lora={self.lora!r} salt={self.cache_salt!r}"

    def spec(self, eos: int | None) -> RequestSpec:
        return RequestSpec(
            request_id=self.request_id,
            prompt_token_ids=self.prompt,
            max_tokens=self.max_tokens,
            eos_token_id=eos,
            arrival_step=self.arrival,
            priority=self.priority,
            cache_salt=self.cache_salt,
            lora=self.lora,
        )


MIGRATION_FAULTS = ("before_ack", "abort_in_transit")
"""Where the suite, playing the link, can make a migration fail (feature ``migration``):
``before_ack``: the transfer breaks after the stage, before the destination acknowledged
(the destination's import is aborted; the request runs on as before on the source);
``abort_in_transit``: the client aborts the request while its K/V travels (the import is
aborted and the source aborts the request: it finishes once, on the source)."""


@dataclass(frozen=True)
class MigrationPlan:
    """One move of a workload (feature ``migration``): at step boundary ``at`` the suite
    moves ``request_id`` from the instance that holds it to instance ``to`` (0 is the
    one requests arrive at), asking for a K/V transfer (``kv``) or a recompute; ``fault``
    (one of :data:`MIGRATION_FAULTS`) makes the link fail. A move of a request that is
    not live then, or already on ``to``, is skipped."""

    at: int
    request_id: str
    to: int = 1
    kv: bool = True
    fault: str | None = None

    def __post_init__(self) -> None:
        if self.fault is not None and self.fault not in MIGRATION_FAULTS:
            raise ValueError(f"fault must be one of {MIGRATION_FAULTS}, got {self.fault!r}")
        if self.to < 0 or self.at < 0:
            raise ValueError(f"a migration needs at >= 0 and to >= 0, got {self!r}")


@dataclass(frozen=True)
class Workload:
    config: EngineConfig
    requests: tuple[RequestPlan, ...]
    max_steps: int = 0
    """Steps after which a run that has not quiesced fails PROGRESS (0: derived)."""
    rollback_at: tuple[int, ...] = ()
    """Steps at which the suite simulates an executor fault (feature ``rollback``)."""
    drafts_right: tuple[tuple[int, str, int], ...] = ()
    """(step, request id, n): at that step the first n drafts the suite proposes to the
    request are its own next tokens and the rest are not, so a verification accepts n
    (feature ``speculative_decoding``; the exhaustive explorer records its choices
    here). Steps not listed use the suite's rotating choice."""
    note: str = ""
    peers: tuple[EngineConfig, ...] = ()
    """The configurations of the other instances of the engine (feature ``migration``):
    instance ``i + 1`` runs ``peers[i]``; requests arrive at instance 0 (``config``)."""
    migrations: tuple[MigrationPlan, ...] = ()
    """Moves between instances, in the order given at each boundary."""
    disaggregated: bool = False
    """Prefill/decode disaggregation: every request is prefilled on instance 0 and moved
    to instance 1, K/V and all, at the first boundary after its first output token."""
    transfer_outcomes: tuple[tuple[int, str, str, str], ...] = ()
    """(step, request id, kind, outcome): what the request's copies of that
    :class:`~refserve.spec.snapshot.TransferKind` in flight at that step do in it (a
    :class:`~refserve.conformance.adapter.TransferOutcome`; feature ``transfer_faults``;
    the exhaustive explorer records its choices here). With choices or a seed, every
    copy in flight at a step gets one: listed, else drawn (:func:`drawn_outcome`), else
    it completes."""
    transfer_seed: int | None = None
    """Draws an outcome for each copy in flight at each step not listed in
    ``transfer_outcomes`` (feature ``transfer_faults``); ``None``: no draws."""

    def __post_init__(self) -> None:
        for step, rid, kind, what in self.transfer_outcomes:
            if kind not in tuple(TransferKind) or what not in tuple(TransferOutcome):
                raise ValueError(
                    f"transfer_outcomes: ({step}, {rid!r}, {kind!r}, {what!r}) needs a kind in "
                    f"{[str(k) for k in TransferKind]} and an outcome in "
                    f"{[str(o) for o in TransferOutcome]}"
                )

    @property
    def instances(self) -> int:
        """How many instances of the engine the workload runs on."""
        used = max((m.to for m in self.migrations), default=0)
        return max(1 + len(self.peers), used + 1, 2 if self.disaggregated else 1)

    def config_of(self, instance: int) -> EngineConfig:
        """Instance ``instance``'s configuration (a peer without one runs ``config``)."""
        if 1 <= instance <= len(self.peers):
            return self.peers[instance - 1]
        return self.config

    @property
    def step_limit(self) -> int:
        if self.max_steps:
            return self.max_steps
        work = sum(len(r.prompt) + r.max_tokens for r in self.requests)
        last = max((r.arrival for r in self.requests), default=0)
        return last + 4 * work * (1 + len(self.requests)) + 64

    @property
    def starvation_bound(self) -> int:
        """Consecutive steps a runnable request may go unscheduled.

        Every other request's whole work (prompt + outputs, recomputed once after a
        preemption) plus the latest arrival: a work-conserving scheduler finishes everyone
        else within it, so exceeding it means the request is being passed over.
        """
        work = sum(2 * (len(r.prompt) + r.max_tokens) for r in self.requests)
        last = max((r.arrival for r in self.requests), default=0)
        return work + last + 8

    def needs(self) -> frozenset[Feature]:
        """Features an engine must have to run this workload."""
        out: set[Feature] = set()
        for cfg in (self.config_of(i) for i in range(self.instances)):
            out |= self._needs_of(cfg)
        if self.instances > 1:
            out.add(Feature.MIGRATION)
        if any(m.fault == "abort_in_transit" for m in self.migrations):
            out.add(Feature.ABORT)
        if self.rollback_at:
            out.add(Feature.ROLLBACK)
        if self.transfer_outcomes or self.transfer_seed is not None:
            out.add(Feature.TRANSFER_FAULTS)
        return frozenset(out | self._needs_of_requests())

    def _needs_of_requests(self) -> set[Feature]:
        """What the requests themselves ask of the engine."""
        out: set[Feature] = set()
        if any(r.abort_at is not None for r in self.requests):
            out.add(Feature.ABORT)
        if len({r.priority for r in self.requests}) > 1:
            out.add(Feature.PRIORITIES)
        if any(r.cache_salt for r in self.requests):
            out.add(Feature.CACHE_SALT)
        if any(r.lora for r in self.requests):
            out.add(Feature.LORA)
        return out

    def _needs_of(self, cfg: EngineConfig) -> set[Feature]:
        """What one instance's configuration asks of the engine."""
        out: set[Feature] = set()
        budget = cfg.max_num_batched_tokens
        if any(len(r.prompt) + r.max_tokens - 1 > budget for r in self.requests):
            # Without chunking a whole sequence must fit in one step's budget: the
            # longest is a recompute after a preemption, the prompt and every output
            # but the last (a request stops at its last output, never recomputing it).
            out.add(Feature.CHUNKED_PREFILL)
        if not cfg.enable_prefix_caching:
            out.add(Feature.PREFIX_CACHING_OPTIONAL)
        if cfg.num_speculative_tokens:
            out.add(Feature.SPECULATIVE_DECODING)
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["requests"] = [_request_json(r) for r in self.requests]
        d["rollback_at"] = list(self.rollback_at)
        d["drafts_right"] = [list(x) for x in self.drafts_right]
        d["migrations"] = [asdict(m) for m in self.migrations]
        d["peers"] = [asdict(c) for c in self.peers]
        d["transfer_outcomes"] = [list(x) for x in self.transfer_outcomes]
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Workload:
        return Workload(
            config=EngineConfig(**d["config"]),
            requests=tuple(
                RequestPlan(**{**r, "prompt": tuple(r["prompt"])}) for r in d["requests"]
            ),
            max_steps=int(d.get("max_steps", 0)),
            rollback_at=tuple(d.get("rollback_at", ())),
            drafts_right=tuple(
                (int(step), str(rid), int(n)) for step, rid, n in d.get("drafts_right", ())
            ),
            note=str(d.get("note", "")),
            peers=tuple(EngineConfig(**c) for c in d.get("peers", ())),
            migrations=tuple(MigrationPlan(**m) for m in d.get("migrations", ())),
            disaggregated=bool(d.get("disaggregated", False)),
            transfer_outcomes=tuple(
                (int(step), str(rid), str(kind), str(what))
                for step, rid, kind, what in d.get("transfer_outcomes", ())
            ),
            transfer_seed=None if d.get("transfer_seed") is None else int(d["transfer_seed"]),
        )


def _request_json(r: RequestPlan) -> dict[str, Any]:
    d = {**asdict(r), "prompt": list(r.prompt)}
    for name in ("cache_salt", "lora"):  # absent when unused: older replays read the same
        if not d[name]:
            del d[name]
    return d


TRANSFER_DRAWS = (
    TransferOutcome.COMPLETE,
    TransferOutcome.COMPLETE,
    TransferOutcome.DELAY,
    TransferOutcome.FAIL,
)
"""The outcomes a seed draws from, equally likely: half the copies land at each step."""


def drawn_outcome(seed: int, step: int, request_id: str, kind: str) -> TransferOutcome:
    """The outcome ``seed`` draws for ``request_id``'s copies of ``kind`` at ``step``: a
    pure function of its arguments, so a run replays."""
    h = hashlib.blake2b(f"{seed}/{step}/{request_id}/{kind}".encode(), digest_size=4)
    return TRANSFER_DRAWS[int.from_bytes(h.digest(), "little") % len(TRANSFER_DRAWS)]


def next_token(tokens: tuple[int, ...] | list[int]) -> int:
    """The fake model's greedy choice after ``tokens``: in ``[2, VOCAB)``, never eos."""
    h = hashlib.blake2b(repr(tuple(tokens[-8:])).encode() + len(tokens).to_bytes(4, "little"))
    return 2 + int.from_bytes(h.digest()[:4], "little") % (VOCAB - 2)


def prompt(seed: int, length: int, prefix: tuple[int, ...] = ()) -> tuple[int, ...]:
    """A deterministic prompt of ``length`` tokens starting with ``prefix``."""
    body = [2 + (seed * 131 + i * 17 + (seed * i) % 7) % (VOCAB - 2) for i in range(length)]
    return (prefix + tuple(body))[:length] if prefix else tuple(body)


@dataclass(frozen=True)
class Scenario:
    """A named workload with what it targets; ``golden`` is the expected schedule.

    ``golden[i]`` is step ``i``'s ((request id, tokens), ...) in plan order for a
    decode-first chunked-prefill engine (refserve's policy); a different schedule is a
    policy observation, never a violation.
    """

    name: str
    description: str
    workload: Workload
    targets: tuple[str, ...] = ()
    golden: tuple[tuple[tuple[str, int], ...], ...] | None = None
    golden_from_step: int = 0
    requires: frozenset[Feature] = field(default_factory=frozenset)

    def needs(self) -> frozenset[Feature]:
        return self.requires | self.workload.needs()
