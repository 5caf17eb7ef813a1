"""The KV-manager-level conformance protocol: a block manager checked on its own.

An engine's scheduler may never fork, never share a partial block, never evict: then the
engine-level suite never reaches those paths of its block manager. This subpackage
drives the block manager directly (allocate, fork, free, snapshot) from a Hypothesis
state machine, with a fake KV memory, so copy-on-write, reference counts, double frees
and stale prefix-cache entries are checked whatever the scheduler does
(``refserve conformance --kv-adapter MODULE:FACTORY``; docs/CONFORMANCE.md).
"""
