"""A planted livelock: the indie engine serving its running prefills least-progress first.

The engine caps every prefill chunk at half the token budget (as vLLM's
``long_prefill_token_threshold`` does, so that a long prompt leaves room for others)
and serves the prefill that is furthest behind first. That sounds fair, and every step
it makes is fine on its own: budget, blocks, positions and preemption by recompute are
all correct, and every step schedules work. Its victim is the running request holding
the most blocks (it frees the most memory). Together they livelock: two prompts that
cannot both fit take turns. The one behind goes first, grows, and preempts the one
ahead (it holds more blocks), which loses its KV and re-enters behind; next the roles
swap.
Neither prompt ever completes, and no step on its own breaks a rule, so the per-step
checks of the conformance suite and its workloads (which never hold two such prompts in
such a pool) pass it. The exhaustive explorer finds the step cycle
(tests/conformance/test_explore.py).
"""

from __future__ import annotations

from indie_adapter import IndieAdapter
from indie_engine import Batch, IndieEngine, Request, State, _by_arrival, _Planner

from refserve.conformance.adapter import EngineConfig


def _least_progress(r: Request) -> tuple[int, int]:
    return (r.computed, r.arrival)


class _CappedPlanner(_Planner):
    def grow(self, r: Request, n: int) -> None:
        """As the indie engine's, but the victim is the request holding the most blocks
        (it frees the most memory), not the latest arrival."""
        eng, bm = self.eng, self.eng.bm
        la = self.lookahead(r, n)
        while bm.blocks_to_allocate(r.rid, n, la) > bm.num_free:
            others = [x for x in eng.running if x.rid not in self.scheduled and x is not r]
            if not others:
                if not self.scheduled:  # alone with every block: it can never grow here
                    eng.running.remove(r)
                    bm.free(r.rid)
                    eng._retire(r, "capacity")
                    self.retired.append((r.rid, "capacity"))
                return
            victim = max(others, key=lambda x: (len(bm.table(x.rid)), x.arrival))
            self.preempt(victim)
        self.schedule(r, n, la, new=False)

    def admit(self) -> None:
        eng, bm = self.eng, self.eng.bm
        cap = max(1, eng.budget // 2)
        while eng.waiting and self.left > 0 and len(eng.running) < eng.max_seqs:
            r = eng.waiting[0]
            n = min(len(r.tokens), self.left, cap)
            if bm.blocks_to_allocate(r.rid, n, self.lookahead(r, n)) > bm.num_free:
                break
            eng.waiting.popleft()
            eng.running.append(r)
            self.schedule(r, n, self.lookahead(r, n), new=True)


class LeastProgressEngine(IndieEngine):
    def _plan(self) -> Batch:
        p = _CappedPlanner(self)
        cap = max(1, self.budget // 2)
        prefills = [r for r in self.running if r.state is State.PREFILL]
        for r in sorted(prefills, key=_least_progress):  # the planted change (was arrival)
            if p.left <= 0:
                break
            if r in self.running:
                p.grow(r, min(len(r.tokens) - r.computed, p.left, cap))
        if not p.preempted:
            p.admit()
        for r in sorted((r for r in self.running if r.state is State.DECODE), key=_by_arrival):
            if p.left <= 0:
                break
            if r in self.running:
                p.grow(r, 1)
        return Batch(tuple(p.chunks), tuple(p.preempted), tuple(p.retired), tuple(p.copies))


class LivelockAdapter(IndieAdapter):
    @property
    def name(self) -> str:
        return "indie 0.1 (least-progress-first prefill)"

    def configure(self, config: EngineConfig) -> None:
        super().configure(config)
        self._eng = LeastProgressEngine(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_batched_tokens=config.max_num_batched_tokens,
            max_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
        )


def make() -> LivelockAdapter:
    return LivelockAdapter()
