"""``refserve conformance --self-check``: walk one request through a new adapter and explain.

The full suite reports what an engine gets wrong as invariant violations over shrunk
workloads; an adapter that is still being written mostly gets the *protocol* wrong
instead (a list where a tuple belongs, a position off by one, a request that vanishes
from the snapshot when it finishes), and the suite's findings then point at the engine
when the adapter is at fault. The self-check is the first thing to run on a new adapter
(docs/ADAPTERS.md, "The self-check"): it builds the adapter, reads its name, features
and declared properties, configures one small engine, adds ONE request and steps it to
its end, and after every call says in plain words what is right and what is not,
field by field and step by step:

* every record is validated structurally (:mod:`refserve.conformance.validate`);
* the request's counters and status are compared with what the protocol implies after
  each step (waiting before its first chunk; prefilling mid-prompt; decoding with
  ``num_computed_tokens == num_tokens - 1`` once its chunk reached the end and sampled;
  finished, and still listed once, after the commit that sampled ``max_tokens``) --
  the KVLEN relations;
* the scheduled positions continue the KV already computed and each slot is
  ``block_table[pos // bs] * bs + pos % bs`` (POS); ``samples`` is set exactly when the
  chunk reaches the last known token (KVLEN);
* the table's ``num_stored`` equals ``num_computed_tokens``, ``token_ids`` are the
  tokens at those positions, and the table holds between ``ceil(num_stored / bs)`` and
  ``ceil((num_stored + lookahead_slots) / bs)`` blocks (POS, the declared lookahead);
* blocks are taken from the head of the free queue (BLOCK, unless the adapter declares
  ``free_queue_order=False``) and all are free again at the end (PROGRESS);
* ``has_unfinished()`` is true exactly while the request is live.

Every adapter call goes through :func:`refserve.conformance.guard.call`, so an exception or a
hang is explained (``schedule() raised KeyError: 'x' at engine.py:12``) instead of
ending the check. Exit status of :func:`self_check_main`: 0 when everything is right,
1 when something is wrong, 2 when the adapter cannot be loaded or built.

The package: :mod:`.protocol` (the engine, the request, the result), :mod:`.explain`
(how findings are worded), :mod:`.checks` (the record-by-record checks) and :mod:`.walk`
(the walk and :func:`self_check`).
"""

from __future__ import annotations

from refserve.conformance.selfcheck.protocol import CONFIG, REQUEST, SelfCheckResult
from refserve.conformance.selfcheck.walk import self_check, self_check_main

__all__ = ["CONFIG", "REQUEST", "SelfCheckResult", "self_check", "self_check_main"]
