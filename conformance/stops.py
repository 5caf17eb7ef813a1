"""When a request must stop (KVLEN): the runner samples every token itself, so it knows
when a stop is due and checks that the engine stopped the request exactly then, with the
right reason (docs/CONFORMANCE.md; the adapter's declared eos handling and
``max_model_len_stop`` say which stops apply)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from refserve.conformance.adapter import EngineProperties
from refserve.conformance.workload import RequestPlan
from refserve.spec.snapshot import EngineSnapshot
from refserve.spec.violation import Invariant, Violation, violation
from refserve.values import is_int

#: The named rule of KVLEN for a declared lack of eos handling kept.
DECLARED_EOS = "declared-eos"


@dataclass(frozen=True)
class MustStop:
    """Why a sampled token must end its request; ``limit`` is set when only the
    max_model_len its snapshot reports stops it (the reason must then be ``length``)."""

    why: str
    limit: int | None = None


@dataclass(frozen=True)
class StopRules:
    """The stops that apply to one engine: eos (when it handles eos), ``max_tokens``
    always, and the reported max_model_len when it declares ``max_model_len_stop``."""

    props: EngineProperties
    eos_token_id: int | None

    def violations(
        self,
        sampled: Mapping[str, int],
        reasons: Mapping[str, str],
        after: EngineSnapshot,
        tokens: Mapping[str, Sequence[int]],
        plans: Mapping[str, RequestPlan],
    ) -> list[Violation]:
        """KVLEN for every request that sampled (``tokens``: its tokens with the sampled
        one; ``reasons``: the finish reasons the engine reported this step)."""
        out: list[Violation] = []
        for rid, tok in sampled.items():
            p = plans.get(rid)
            if p is None:
                continue
            n_tokens = len(tokens[rid])
            must = self.must_stop(rid, p, tok, n_tokens, after)
            out += self._wrong_stop(rid, p, tok, must, n_tokens, reasons.get(rid), after)
            out += self._declared_no_eos(rid, tok, must, reasons.get(rid))
        return out

    def _declared_no_eos(
        self, rid: str, tok: int, must: MustStop | None, reason: str | None
    ) -> list[Violation]:
        """KVLEN, rule ``declared-eos``: an engine declared without eos handling
        (``EngineProperties(eos=False)``) keeps running when it samples the eos token.
        The suite samples eos at a forced stop either way, so the declaration is held
        both ways: with ``True`` the request must stop there, with ``False`` it must not
        (an engine that does stop has an eos path the suite was told not to test)."""
        if self.props.eos or tok != self.eos_token_id or must is not None or reason != "stop":
            return []
        return [
            violation(
                Invariant.KVLEN,
                f"request {rid}",
                "stopped on its eos token, which the adapter declares the engine does not "
                "handle (EngineProperties(eos=False))",
                "running",
                "finished (stop)",
                rule=DECLARED_EOS,
            )
        ]

    def must_stop(
        self, rid: str, p: RequestPlan, tok: int, n_tokens: int, after: EngineSnapshot
    ) -> MustStop | None:
        """Why sampling ``tok`` must end ``rid``, or None when nothing stops it."""
        # An engine without eos handling is never asked to stop on one (choose()).
        if self.props.eos and tok == self.eos_token_id:
            return MustStop("sampled its eos token")
        if n_tokens - len(p.prompt) >= p.max_tokens:
            return MustStop(f"reached max_tokens {p.max_tokens}")
        # Declared max_model_len_stop: reaching the max_model_len the request's own
        # snapshot reports stops it too (reason length), as vLLM's check_stop does.
        limit = self.reported_max_model_len(after, rid)
        if limit is not None and n_tokens >= limit:
            return MustStop(f"reached its max_model_len {limit} ({n_tokens} tokens)", limit)
        return None

    def _wrong_stop(
        self,
        rid: str,
        p: RequestPlan,
        tok: int,
        must: MustStop | None,
        n_tokens: int,
        reason: str | None,
        after: EngineSnapshot,
    ) -> list[Violation]:
        """Stopped when it must (with reason length at the max_model_len), not stopped
        for ``stop`` or ``length`` when it need not."""
        who = f"request {rid}"
        out: list[Violation] = []
        if must is not None and reason is None:
            out.append(violation(Invariant.KVLEN, who, f"{must.why} but kept running"))
        elif must is not None and must.limit is not None and reason != "length":
            out.append(
                violation(
                    Invariant.KVLEN,
                    who,
                    f"reached its max_model_len {must.limit} and finished with reason "
                    f"{reason}, not length",
                )
            )
        # An eos stop the engine declares it does not make: reported as declared-eos.
        undeclared_eos = not self.props.eos and reason == "stop" and tok == self.eos_token_id
        if must is None and reason in ("stop", "length") and not undeclared_eos:
            r = after.request(rid)
            hint = ""
            if (
                not self.props.max_model_len_stop
                and reason == "length"
                and r is not None
                and r.max_model_len == n_tokens
            ):
                hint = (
                    f" (it reached the max_model_len {n_tokens} its snapshot reports: "
                    "an engine that stops there declares "
                    "EngineProperties(max_model_len_stop=True))"
                )
            out.append(
                violation(
                    Invariant.KVLEN,
                    who,
                    f"finished with reason {reason} after {n_tokens - len(p.prompt)} outputs "
                    "without a stop" + hint,
                )
            )
        return out

    def reported_max_model_len(self, after: EngineSnapshot, rid: str) -> int | None:
        """The ``max_model_len`` the request's snapshot after the commit reports, when the
        adapter declared ``max_model_len_stop`` (else None: only eos, stop tokens and
        ``max_tokens`` may stop a request)."""
        if not self.props.max_model_len_stop:
            return None
        r = after.request(rid)
        if r is None or not is_int(r.max_model_len):
            return None  # a missing or malformed record is reported by the snapshot checks
        return r.max_model_len
