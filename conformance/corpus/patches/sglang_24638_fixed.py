"""sglang#24638's proposed fix applied to SGLang 0.5.23's request class: the clean side.

* Tracker: https://github.com/sgl-project/sglang/issues/24638 ("Base-model request can
  collide with LoRA radix-cache namespace via crafted extra_key"; closed as inactive).
* Proposed fix: https://github.com/sgl-project/sglang/pull/25351 ("Fix LoRA prefix cache
  namespace collisions"), closed without being merged (it superseded #25214, closed the
  same way). SGLang 0.5.23 ships the bug, so the buggy side of the entry is the plain
  adapter, :func:`refserve.conformance.adapters.sglang_kv.make_kv`, and this module is
  the clean side.

The bug. SGLang's radix tree keys a page by ``(req.extra_key, page tokens)``
(``RadixKey.child_key_at``, ``sglang/srt/mem_cache/radix_cache.py`` lines 246-247), and
``Req.__init__`` (``sglang/srt/managers/schedule_batch.py``, lines 1164-1170 in 0.5.23)
builds ``extra_key`` by joining the caller's key and the LoRA adapter's id end to end::

    if lora_id is not None:
        extra_key = (
            extra_key or ""
        ) + lora_id  # lora_id is concatenated to the extra key

    self.extra_key = extra_key

So a base-model request whose ``extra_key`` is an adapter's id gets the adapter's
namespace, and a request on adapter ``bc`` with key ``a`` gets the namespace of one on
adapter ``c`` with key ``ab``: the second request is served K/V computed under other
weights (the tracker: a deterministic output changed once the LoRA request had run).

The fix's structure, as PR 25351 describes it: a base request's own key stays as it is
(no composition is needed); a composed namespace (LoRA id, caller's key) is made of
tagged parts, so that no caller's key can equal it and no two compositions can equal
each other. The PR encodes the parts as a string under a reserved prefix and escapes
callers' keys that begin with it. This module builds the composed namespace as a tuple
of tagged parts instead: the radix tree keys by any hashable value, and no caller's
string can equal a tuple, so no escape is needed; the separation is the PR's.

Applied, on the objects this factory builds only, as :class:`TaggedNamespaceReq`, a
subclass of SGLang's ``Req`` whose constructor runs SGLang's own with ``lora_id`` left
out (so the concatenation does not run) and then sets ``lora_id`` and the tagged
``extra_key``; :class:`Sglang24638FixedAdapter` builds its requests with that class
(``SglangKVAdapter.req_class``). The module refuses to import
(:func:`refserve.conformance.corpus.hunk.require_lines`) unless the installed
``Req.__init__`` still has the lines above: on a release that fixed it, this clean side
would be testing something else.
"""

from __future__ import annotations

from typing import Any

from refserve.conformance.adapters.sglang_kv import SG, SglangKVAdapter
from refserve.conformance.corpus.hunk import require_lines

BUG = "sgl-project/sglang#24638"
BUGGY = "refserve.conformance.adapters.sglang_kv:make_kv"
FIXED = "refserve.conformance.corpus.patches.sglang_24638_fixed:make_kv"

require_lines(
    BUG,
    SG.Req.__init__,
    (
        "if lora_id is not None:",
        'extra_key or ""',
        ") + lora_id  # lora_id is concatenated to the extra key",
        "self.extra_key = extra_key",
        "self.lora_id = lora_id",
    ),
)


_SglangReq: Any = SG.Req


class TaggedNamespaceReq(_SglangReq):  # type: ignore[misc]  # SGLang's Req (untyped)
    """SGLang's ``Req`` with the LoRA namespace composed of tagged parts."""

    def __init__(self, *args: Any, lora_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lora_id = lora_id
        if lora_id is not None:
            self.extra_key = (("lora", lora_id), ("extra_key", kwargs.get("extra_key")))


class Sglang24638FixedAdapter(SglangKVAdapter):
    """The adapter whose requests carry the tagged namespace (the proposed fix)."""

    name = "sglang-radix-kv+24638-fix"
    req_class = TaggedNamespaceReq


def make_kv() -> Sglang24638FixedAdapter:
    """SGLang 0.5.23's radix cache with PR 25351's namespace structure."""
    return Sglang24638FixedAdapter()
