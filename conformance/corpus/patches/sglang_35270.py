"""sglang#35270 re-applied to SGLang 0.5.23's radix cache, for the KV-level suite.

Tracker: https://github.com/sgl-project/sglang/issues/35270 ("Radix cache
``evictable_size()`` double-counts shared pages, killing the scheduler at idle"). Fix:
https://github.com/sgl-project/sglang/pull/35470 ("[dLLM] Don't cache the in-flight
denoise block in the radix tree"), extended to the other radix caches by
https://github.com/sgl-project/sglang/pull/35781.

What the tracker describes: with the radix cache on, a diffusion (dLLM) run finishes every
request and then the scheduler's idle check raises ``pool memory leak detected! [full]
total=469952, available=96, evictable=470016``: available plus evictable is 160 tokens
(5 pages) more than the pool holds. Nothing leaks; the tree counts the same pages under
two nodes. A dLLM request's trailing block is a whole page whose token ids are rewritten
on every denoise step (``dllm_incomplete_ids``), and ``cache_unfinished_req`` caches it
anyway. The next checkpoint's key diverges at that page, the match falls below
``cache_protected_len``, the ``free_segment(kv_indices[cache_protected_len:prefix_len])``
slice is empty, and the new node claims the pages the previous node still owns.

The hunk (PR 35470, ``RadixCache.cache_unfinished_req``; PR 35781 makes the same change
in the SWA, mamba, unified and C++ caches)::

    -        token_ids = req.get_fill_ids()
    +        token_ids = req.get_cacheable_fill_ids()

with ``ReqDllmMixin.get_cacheable_fill_ids()`` returning the fill ids without the
in-flight incomplete block. Re-applied here (before: the bug) as an override of
:meth:`SglangKVAdapter._checkpoint_ids` on the adapters this factory builds, never on the
module: the checkpoint of a running request keys ``req.get_fill_ids()``. In SGLang 0.5.23
``cache_unfinished_req`` is ``RadixCache.checkpoint(req, up_to=...)``, reading
``req.full_untruncated_fill_ids[:up_to]``, so the adapter passes the length of the chosen
ids as ``up_to``. The two differ only for a dLLM request with a block in flight, which is
why the factory drives dLLM requests (``dllm=True``: every allocation's new tokens are a
block checkpointed in flight with mask ids, resolved to the suite's tokens at the next
call); :func:`refserve.conformance.adapters.sglang_kv.make_kv_dllm` is the same flow on the
fixed code and passes.

How the re-applied code was checked against the tracker: SGLang's regression test for
the fix (``test_accounting_does_not_exceed_owned_pages``: a settled prefix, one volatile
page checkpointed under two different keys) asserts ``evictable_size() +
protected_size()`` does not exceed the tokens of the distinct pages the tree holds. The
same sequence through this factory (two checkpoints of one block, first with mask ids,
then resolved) leaves two tree nodes on one page and ``available_size() +
evictable_size()`` a page per node above the blocks the pool really has free or evictable,
the tracker's excess of whole pages; the fixed flow leaves one node and equal figures
(tests/conformance/test_sglang_kv.py). The suite reports it under BLOCK as the manager's
stated count of free and evictable blocks differing from the blocks.
"""

from __future__ import annotations

from array import array

from refserve.conformance.adapters.sglang_kv import SglangKVAdapter, _Req

FIXED = "refserve.conformance.adapters.sglang_kv:make_kv"
BUGGY = "refserve.conformance.corpus.patches.sglang_35270:make_kv"
FIXED_DLLM = "refserve.conformance.adapters.sglang_kv:make_kv_dllm"
"""The fixed code under the same dLLM flow the buggy factory drives."""


class Sglang35270Adapter(SglangKVAdapter):
    """The adapter with the checkpoint keying the in-flight block (the bug)."""

    name = "sglang-radix-kv+35270"

    def _checkpoint_ids(self, req: _Req) -> array[int]:
        return req.get_fill_ids()


def make_kv() -> Sglang35270Adapter:
    """SGLang's radix cache with sglang#35270's hunk re-applied, on dLLM requests."""
    return Sglang35270Adapter(dllm=True)
