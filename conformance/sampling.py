"""The suite's model of the world outside the scheduler: it samples every token itself,
proposes the drafts and verifies them, and decides how each copy in flight ends.

What it decides at each point is a :class:`Choices`: the workload's by default (its
``stop_at``, ``drafts_right``, ``transfer_outcomes`` or ``transfer_seed``), the
explorer's when it enumerates them (:mod:`refserve.conformance.explore.session`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from refserve.conformance.adapter import EngineConfig, EngineProperties, StepReport
from refserve.conformance.adapter import TransferOutcome as Outcome
from refserve.conformance.probe import Probe, RunStopped
from refserve.conformance.workload import RequestPlan, Workload, drawn_outcome, next_token
from refserve.spec.snapshot import EngineSnapshot, RequestStatus, ScheduledRequest
from refserve.spec.violation import Invariant

COMPLETE = Outcome.COMPLETE
MAX_TRANSFER_DELAYS = 2
"""Steps in a row a seed may delay one copy group; it then completes (or fails), so a
drawn run quiesces."""


class Choices:
    """The workload's choices: the token a request samples, how many drafts are right,
    how a copy group ends."""

    def __init__(self, workload: Workload, eos_token_id: int | None) -> None:
        self.w = workload
        self.eos_token_id = eos_token_id

    @property
    def chooses_transfers(self) -> bool:
        """Whether the suite decides the copies in flight (feature ``transfer_faults``)."""
        return bool(self.w.transfer_outcomes) or self.w.transfer_seed is not None

    def token(self, plan: RequestPlan, toks: list[int], eos_declared: bool) -> int:
        """The token ``plan``'s request samples after ``toks``."""
        n_out = len(toks) - len(plan.prompt) + 1
        forced = plan.stop_at is not None and n_out == plan.stop_at
        # Sampled whether the engine handles eos or not: with eos=False the request must
        # keep running (conformance/stops.py, rule declared-eos).
        if forced and self.eos_token_id is not None:
            return self.eos_token_id
        return next_token(toks)

    def right_drafts(self, rid: str, n: int, step: int, known: int) -> int:
        """How many of the ``n`` drafts proposed to ``rid`` (which knows ``known`` tokens)
        at ``step`` are right: the workload's choice if it made one, else one rotating
        with the step and length."""
        for at, who, right in self.w.drafts_right:
            if at == step and who == rid:
                return min(right, n)
        return (step + known) % (n + 1)

    def transfer_outcome(self, rid: str, kind: str, step: int, delays: int) -> Outcome:
        """The workload's choice for ``rid``'s copies of ``kind`` at ``step`` if it made
        one, else its seed's draw (a copy drawn :data:`MAX_TRANSFER_DELAYS` delays in a
        row, ``delays`` so far, completes), else completion."""
        for at, who, k, what in self.w.transfer_outcomes:
            if (at, who, k) == (step, rid, kind):
                return Outcome(what)
        seed = self.w.transfer_seed
        if seed is None:
            return COMPLETE
        drawn = drawn_outcome(seed, step, rid, kind)
        if drawn is Outcome.DELAY and delays >= MAX_TRANSFER_DELAYS:
            return COMPLETE
        return drawn


@dataclass
class Sampled:
    """What the suite's model answers to one step report: the token sampled per request,
    the drafts accepted per verified request, and the tokens each request gains."""

    sampled: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    gained: dict[str, list[int]] = field(default_factory=dict)


class TokenModel:
    """The tokens of every request (shared by the instances of one run: a request's
    tokens move with it), and the suite's sampling and verification of them."""

    def __init__(
        self,
        probe: Probe,
        choices: Choices,
        cfg: EngineConfig,
        props: EngineProperties,
        tokens: dict[str, list[int]],
        plans: dict[str, RequestPlan],
    ) -> None:
        self.probe = probe
        self.choices = choices
        self.cfg = cfg
        self.props = props
        """The engine's declared properties (read again once it is configured)."""
        self.tokens = tokens
        self.plans = plans

    def sample(
        self, plan: StepReport, proposals: Mapping[str, tuple[int, ...]], step: int
    ) -> Sampled:
        """A token for every entry that samples (TOKEN: only for a request the suite
        knows), its drafts verified first when it carries some."""
        out = Sampled()
        for s in plan.scheduled:
            if not s.samples:
                continue
            toks = self.tokens.get(s.request_id)
            if toks is None:
                self.probe.fail(
                    Invariant.TOKEN, step, "step", f"request {s.request_id}", "unknown id scheduled"
                )
                continue
            if s.num_draft_tokens:
                self.verify(s, proposals, out, step)
            else:
                out.sampled[s.request_id] = self.choose(s.request_id, toks)
                out.gained[s.request_id] = [out.sampled[s.request_id]]
        return out

    def propose(self, before: EngineSnapshot, step: int) -> dict[str, tuple[int, ...]]:
        """Drafts for every decoding request (feature ``speculative_decoding``): the
        suite's own next tokens up to a point it chooses by the step, then tokens it will
        not sample, so it decides how many a verification accepts; never past a stop."""
        k = self.cfg.num_speculative_tokens
        out: dict[str, tuple[int, ...]] = {}
        for r in before.requests:
            rid = r.request_id
            if r.status is not RequestStatus.DECODING or rid not in self.tokens:
                continue
            truth = self.truth(rid, k + 1)
            n = min(k, len(truth) - 1)  # the token at a stop is the target's own
            if n < 1:
                continue
            right = self.choices.right_drafts(rid, n, step, len(self.tokens[rid]))
            drafts = (*truth[:right], *(t ^ 1 for t in truth[right:n]))  # t ^ 1 != t
            propose = self.probe.a.propose  # type: ignore[attr-defined]  # feature-gated method
            self.probe.call(step, "step", f"propose({rid!r})", lambda: propose(rid, drafts))  # noqa: B023
            out[rid] = drafts
        return out

    def truth(self, rid: str, n: int) -> list[int]:
        """The next ``n`` tokens the suite samples for ``rid``, cut after a stop."""
        p = self.plans[rid]
        toks = list(self.tokens[rid])
        out: list[int] = []
        while len(out) < n:
            t = self.choose(rid, toks)
            toks.append(t)
            out.append(t)
            eos = self.props.eos and t == self.cfg.eos_token_id
            if (
                eos
                or len(toks) - len(p.prompt) >= p.max_tokens
                or len(toks) >= self.cfg.max_model_len
            ):
                break
        return out

    def verify(
        self,
        s: ScheduledRequest,
        proposals: Mapping[str, tuple[int, ...]],
        out: Sampled,
        step: int,
    ) -> None:
        """The suite's verification of ``s``'s drafts: the leading drafts equal to its
        own tokens are accepted, then its next token is the one sampled."""
        rid, d = s.request_id, s.num_draft_tokens
        drafts = proposals.get(rid, ())[:d]
        if len(drafts) != d:
            self.probe.fail(
                Invariant.TOKEN,
                step,
                "step",
                f"request {rid}",
                "verifies more drafts than the suite proposed",
                f"<= {len(drafts)}",
                d,
            )
            raise RunStopped
        truth = self.truth(rid, d + 1)
        a = 0
        while a < d and drafts[a] == truth[a]:
            a += 1
        out.accepted[rid] = a
        out.sampled[rid] = truth[a]
        out.gained[rid] = truth[: a + 1]

    def choose(self, rid: str, toks: list[int]) -> int:
        return self.choices.token(self.plans[rid], toks, self.props.eos)


class CopyOutcomes:
    """How each copy group (request, kind) in flight ends, named to the adapter before
    each step, with the delays each group has had in a row."""

    def __init__(self, probe: Probe, choices: Choices) -> None:
        self.probe = probe
        self.choices = choices
        self.delays: dict[tuple[str, str], int] = {}
        """Consecutive steps each copy group (request, kind) was drawn a delay."""
        self.used: list[tuple[int, str, str, str]] = []
        """Every outcome named to the adapter (a replay's ``transfer_outcomes``)."""

    def decide(self, before: EngineSnapshot, step: int) -> dict[tuple[str, str], Outcome]:
        """An outcome for each copy group in flight at the boundary, named to the adapter
        before the step."""
        groups = dict.fromkeys((x.request_id, str(x.kind)) for x in before.pool.transfers)
        outcomes = {
            g: self.choices.transfer_outcome(g[0], g[1], step, self.delays.get(g, 0))
            for g in groups
        }
        for g in list(self.delays):
            if outcomes.get(g) is not Outcome.DELAY:
                del self.delays[g]
        for g, o in outcomes.items():
            if o is Outcome.DELAY:
                self.delays[g] = self.delays.get(g, 0) + 1
            self.used.append((step, g[0], g[1], str(o)))
        hook = self.probe.a.transfer_outcomes  # type: ignore[attr-defined]  # feature-gated
        self.probe.call(step, "step", "transfer_outcomes()", lambda: hook(dict(outcomes)))
        return outcomes


__all__ = [
    "COMPLETE",
    "MAX_TRANSFER_DELAYS",
    "Choices",
    "CopyOutcomes",
    "Sampled",
    "TokenModel",
]
