"""Shared pieces of the prefill/decode role tests (test_cluster_pd.py, its transformers
and Ray companions): the configurations, and a drive loop that checks the rules of
spec/pd.py and the ownership rule after every step."""

from __future__ import annotations

from cluster_helpers import config

from refserve.cluster import Cluster, ReplicaDead
from refserve.cluster.disagg import Deflection, Roles, TTFTBound
from refserve.model.sampler import SamplingParams
from refserve.spec.pd import DecodeStep, PDSnapshot, RoleName, check_deflect, check_roles

CFG = config(4, 48, 8)
ROLES = Roles.parse("2P2D", 4)
#: No prefill meets a TTFT of 0 ms: each is deflected where a decode replica predicts less.
EVERY = Deflection(TTFTBound(0.0), tbt_slo_ms=12.0)

Work = list[tuple[str, list[int], SamplingParams]]
Finals = dict[tuple[str, int], tuple[int, ...]]


class Run:
    """Drives a cluster to the end, checking the rules after every step: ownership,
    spec/pd.py's snapshot rules, rule ``first`` read directly, rule ``deflect`` on every
    decode step. Keeps the final outputs, the snapshots and the decode steps."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.finals: Finals = {}
        self.snapshots: list[PDSnapshot] = []
        self.decode_steps: list[DecodeStep] = []
        self.failed: dict[str, ReplicaDead] = {}  # take_failures, after every step
        self.failed_at: dict[str, int] = {}  # request -> the step that ended it failed
        self.delivered: dict[str, int] = {}  # request -> the last step with an output of it

    def add(self, work: Work) -> None:
        for rid, prompt, params in work:
            self.cluster.add_request(prompt, params, request_id=rid)
        self.check()

    def check(self) -> None:
        c = self.cluster
        assert c.ownership_violations() == []
        snap = c.pd_snapshot()
        assert check_roles(snap) == []
        for r in snap.requests:
            if r.role is RoleName.PREFILL and not r.kept:
                assert r.sampled_here <= 1, r
        steps = c.take_decode_steps()
        for step in steps:
            assert check_deflect(step) == [], step
        self.snapshots.append(snap)
        self.decode_steps.extend(steps)

    def step(self) -> None:
        for o in self.cluster.step():
            self.delivered[o.request_id] = len(self.snapshots)
            if o.finished:
                key = (o.request_id, o.index)
                assert key not in self.finals, f"{o.request_id} finished twice"
                self.finals[key] = o.token_ids
        for rid, error in self.cluster.take_failures().items():
            assert rid not in self.failed, f"{rid} failed twice"
            self.failed[rid] = error
            self.failed_at[rid] = len(self.snapshots)
        self.check()

    def to_end(self, max_steps: int = 600) -> Finals:
        for _ in range(max_steps):
            if not self.cluster.has_work:
                return self.finals
            self.step()
        raise AssertionError(f"the cluster still has work after {max_steps} steps")

    @property
    def handed_off(self) -> set[str]:
        """The requests that moved by a handoff (one that finished in the step that
        handed it off is in no snapshot: the ledger's record of attempts has it)."""
        assert self.cluster.pd is not None
        moved = [a.decision.request_id for a in self.cluster.pd.attempts if a.moved]
        assert len(moved) == len(set(moved)), "a request handed off twice"
        seen = {r.request_id for s in self.snapshots for r in s.requests if r.handoffs}
        assert seen <= set(moved)
        return set(moved)

    @property
    def kept(self) -> set[str]:
        """The requests whose handoff failed (they stayed on their prefill replica)."""
        assert self.cluster.pd is not None
        kept = {a.decision.request_id for a in self.cluster.pd.attempts if not a.moved}
        assert {r.request_id for s in self.snapshots for r in s.requests if r.kept} <= kept
        return kept
