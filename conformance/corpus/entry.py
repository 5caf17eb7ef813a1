"""One bug of the corpus: where it was reported, which code shipped it, how it is run.

An entry is plain data. It names two adapter factories, the engine's code with the bug
and the same engine without it, and the suite runs that catch it (:class:`Detector`);
:mod:`refserve.conformance.corpus.run` runs both sides and records what each found.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Reproduction(StrEnum):
    """How close to the engine's shipped code a reproduction is, best first."""

    RELEASED = "released"
    """The released version that shipped the bug, installed by its make target and
    driven by its adapter unchanged."""
    REAPPLIED = "reapplied"
    """The current release with the bug's hunk put back at run time by a patch module
    (``refserve.conformance.corpus.patches``) that cites the fixing change; the patch
    changes only the objects its factory builds."""
    MODEL = "model"
    """A model of the buggy logic, for an engine whose code cannot run here; counted
    apart from the reproductions on real code."""


class Rule(StrEnum):
    """The rule an entry breaks: an invariant of spec/, named finer where one has parts.

    Each value is what the findings of that rule carry (``Violation.rule``, or the
    invariant's id for its original checks), so a run can tell which rule caught a bug.
    """

    KEY_DOMAINS = "key-domains"
    """PREFIX: K/V computed in one key domain (adapter, cache salt) or behind one prefix
    never serves another."""
    STATED_FREE = "stated-free"
    """BLOCK: a manager's own count of free and evictable blocks equals the blocks."""
    IN_FLIGHT = "in-flight"
    """BLOCK: the blocks of a copy to or from another store belong to it until it lands."""
    DECLARED_STEP_ORDER = "declared-step-order"
    """ORDER: an engine that declares decode-first admits nobody past a decode."""
    PREFIX = "PREFIX"
    TOKEN = "TOKEN"
    PROGRESS = "PROGRESS"
    BLOCK = "BLOCK"
    POS = "POS"
    KVLEN = "KVLEN"


#: The rules added with the corpus: a bug whose findings all come from these (or from
#: requests only the corpus's scenarios send) was missed by the suite before it.
NEW_RULES = frozenset(
    {Rule.KEY_DOMAINS, Rule.STATED_FREE, Rule.IN_FLIGHT, Rule.DECLARED_STEP_ORDER}
)


@dataclass(frozen=True)
class Detector:
    """The suite runs that catch a bug: fixed scenarios of the library (engine level) or
    of the KV level, by name. Both sides of an entry run exactly these."""

    scenarios: tuple[str, ...] = ()
    """Engine-level scenario names (refserve.conformance.scenarios)."""
    kv_scenarios: tuple[str, ...] = ()
    """KV-level scenario names (refserve.conformance.kv.scenarios)."""

    def __post_init__(self) -> None:
        if not (self.scenarios or self.kv_scenarios):
            raise ValueError("a detector runs at least one scenario")


@dataclass(frozen=True)
class Entry:
    """One real bug, with its reproduction on the engine's code."""

    bug: str
    """The tracker reference, ``owner/repo#N`` (an issue or a pull request)."""
    url: str
    fix: str
    """The fixing change (a pull request or commit URL), or what stands in for it."""
    engine: str
    """The engine's name as its adapter reports it (``vllm``, ``nano-vllm``, ``sglang``)."""
    affected: str
    """The versions or commits that shipped the bug."""
    fixed: str
    """The first version or commit without it."""
    symptom: str
    rule: Rule
    reproduction: Reproduction
    environment: str
    """The make target whose virtualenv runs it (``conformance-vllm``); ``""``: refserve's
    own environment (such entries run in ``make test``)."""
    buggy: str
    """``MODULE:FACTORY`` of the adapter over the code with the bug."""
    clean: str
    """``MODULE:FACTORY`` of the adapter over the code without it."""
    detector: Detector
    requires: str
    """A module that must import for the entry to run here (``vllm``, ``nanovllm``)."""

    def __post_init__(self) -> None:
        if "#" not in self.bug:
            raise ValueError(f"bug must be a tracker reference owner/repo#N, got {self.bug!r}")
        for name in ("buggy", "clean"):
            value = getattr(self, name)
            if ":" not in value:
                raise ValueError(f"{name} must be MODULE:FACTORY, got {value!r}")
        object.__setattr__(self, "rule", Rule(self.rule))
        object.__setattr__(self, "reproduction", Reproduction(self.reproduction))
