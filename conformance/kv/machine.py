"""KV-manager conformance: a Hypothesis-driven checker for any :class:`KVAdapter`.

The suite plays scheduler and model for a block manager on its own. Each example is a
*workload*: a :class:`~refserve.conformance.kv.protocol.KVConfig` and a plain-data op list (JSON),
replayable with :func:`replay_kv`:

* ``{"op": "new", "rid": "r1", "prompt": [..], "n": 3}``: first allocation of a request
  whose known tokens are ``prompt``, for ``n`` new tokens (plus any cache hit);
  optional ``"lora"`` and ``"cache_salt"`` strings name its key namespace (feature
  ``key_domains``; an adapter without it skips such an op);
* ``{"op": "grow", "rid": "r1", "append": [..], "n": 1}``: the request learns the tokens
  ``append`` (decode outputs; ``[]`` for the rest of a chunked prompt) and asks for ``n``
  more (clipped to the tokens it knows and has not stored);
* ``{"op": "fork", "parent": "r1", "child": "r2"}`` (feature ``fork``);
* ``{"op": "free", "rid": "r1"}``.

An op naming a request that is not live (or a fork into a live one) is skipped, so a
shrunk op list always replays. After the ops every live request is freed (the *drain*,
reported as op ``len(ops)``) and the pool must be quiescent.

The suite keeps the logical truth per request (its known tokens, how many are stored,
how many came from the cache) and a fake KV memory (slot -> token id). After EVERY op:

* BLOCK, CAP, POS, PREFIX: :func:`refserve.spec.checks.check_pool` on the snapshot;
* KVLEN: each table's ``num_stored`` is the suite's count (previous + hit + new);
  PREFIX: its ``token_ids`` are the request's own tokens;
* read-back: every live request reads its own tokens through its table. The suite
  writes each new position's token at its slot through the *returned* table, after
  performing the returned copies, so a copy-on-write done but not reported, or a block
  released while still held (ref count too low, double free), shows as a wrong or
  missing token (BLOCK); a wrong token in a shared or cache-hit block (a stale cache
  entry) is PREFIX, as in refserve.conformance.runner's read-back; so is the right token
  computed in another key namespace (feature ``key_domains``: the memory keeps, per
  slot, the namespace of the request that wrote it; rule ``key-domains``);
* PREFIX: a write lands only in a block the writer holds alone (copy-on-write); a cache
  hit is whole blocks, only on a first allocation, only with caching on, and leaves the
  last known token to be computed (KVLEN if hit + new tokens exceed the known tokens);
* POS: the returned ``Allocation.block_table`` is the snapshot's table and covers every
  new position;
* ATOMIC: a :class:`NoSpace` leaves the snapshot unchanged (the free *set*: free-queue
  order is a design choice of the manager and never compared); CAP: a NoSpace while the
  snapshot shows enough free blocks for the call without any cache hit (plus one for a
  copy-on-write) is a finding;
* PROGRESS: after the drain no table remains and no block is referenced
  (:func:`refserve.spec.progress.check_quiescent`); an adapter call that raises (other than the
  protocol's answers) or runs past the time limit, and a snapshot or Allocation not
  shaped as the protocol says, are findings naming the call, never a crash.

An example stops at the first op with a finding (later state is collateral damage).
:func:`run_kv_suite` runs the fixed scenarios, then ``max_examples`` generated examples
without stopping at the first failure, keeps the first workload per finding signature
(:func:`refserve.conformance.report.signature_of`: invariant, first word of the subject, message
with its numbers blanked) and shrinks each one by greedy delta debugging that keeps
that exact signature. Signatures in a baseline (``known``) are counted, not failed.

The level, one concept a module: :mod:`.workload` (workloads, scenarios, findings),
:mod:`.shape` (reading the adapter's answers), :mod:`.checks` (the checks above that
:mod:`spec` does not make), :mod:`.run` (one workload, op by op), :mod:`.shrink`,
:mod:`.search` (the generated examples), :mod:`.scenarios` (the fixed ones) and
:mod:`.suite` (results and the entry point). Everything public is importable from here.
"""

from __future__ import annotations

from refserve.conformance.kv.run import KV_INVARIANTS, replay_kv
from refserve.conformance.kv.scenarios import GENERATED_NAME, kv_scenario_names, kv_scenarios
from refserve.conformance.kv.search import MAX_OPS, Found, KVSearchOutcome, search_kv
from refserve.conformance.kv.shape import as_features, normalize_snapshot
from refserve.conformance.kv.shrink import MAX_SHRINK_RUNS, shrink_kv
from refserve.conformance.kv.suite import (
    load_kv_factory,
    probe_features,
    run_kv_fixed,
    run_kv_generated,
    run_kv_suite,
)
from refserve.conformance.kv.workload import KVFinding, KVScenario, KVWorkload

__all__ = [
    "GENERATED_NAME",
    "KV_INVARIANTS",
    "MAX_OPS",
    "MAX_SHRINK_RUNS",
    "Found",
    "KVFinding",
    "KVScenario",
    "KVSearchOutcome",
    "KVWorkload",
    "as_features",
    "kv_scenario_names",
    "kv_scenarios",
    "load_kv_factory",
    "normalize_snapshot",
    "probe_features",
    "replay_kv",
    "run_kv_fixed",
    "run_kv_generated",
    "run_kv_suite",
    "search_kv",
    "shrink_kv",
]
