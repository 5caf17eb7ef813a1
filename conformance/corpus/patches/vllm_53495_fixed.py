"""vllm#53495 fixed on vLLM 0.33.0: ``ExampleConnector`` keyed on the request's block
hashes, so the cache salt and the LoRA adapter separate its stored K/V.

vLLM 0.33.0 ships the bug (the adapter :mod:`refserve.conformance.adapters.vllm_example`
runs the connector as installed), so this module is the other side of the pair: the
proposed fix, applied to a connector class of its own that only its factory's scheduler
builds. The fix is not merged.

* Tracker: https://github.com/vllm-project/vllm/issues/53495 ("ExampleConnector keys
  external KV on raw prompt tokens, so cache_salt, LoRA and prompt_embeds do not
  partition it"; open).
* Fix proposed: https://github.com/vllm-project/vllm/pull/53496 ("Key ExampleConnector
  storage on block hashes"; open, not merged): the storage key is derived on the
  scheduler side from the hash of the last stored block in ``request.block_hashes``
  (whose chain already binds the tokens, the cache salt, the LoRA adapter, media and
  prompt embeddings), recorded at ``update_state_after_alloc`` and carried in the
  connector's metadata, and the worker only joins it to the storage path; store and
  load agree on one token count.

The bug, as installed (``vllm/distributed/kv_transfer/kv_connector/v1/
example_connector.py``, vLLM 0.33.0):

* ``_found_match_for_request`` (lines 393-401) looks up
  ``list(request.prompt_token_ids or [])`` and the media identifiers only;
* ``build_connector_meta`` (lines 312-387) decides a store with
  ``if not self._found_match_for_prompt(token_ids, mm_hashes):`` (line 345), tokens and
  media only;
* ``_generate_foldername_debug`` (lines 418-438) names the folder
  ``safe_hash(token_bytes)`` with ``token_bytes = token_ids.numpy().tobytes()``
  (line 427) plus the media identifiers, and the worker's save and load
  (``_generate_filename_debug``, lines 440-452) use the same name.

Nothing reads ``request.cache_salt``, ``request.lora_request`` or
``request.block_hashes``: two requests with the same prompt under two salts (or two
adapters) name one folder, and the second is handed the first's K/V as a hit.

The fix as applied here, :class:`ExampleConnector53495Fixed` (a subclass; vLLM's class
is untouched):

* the token count a record covers is the installed lookup's,
  ``align_to_block_size(len(prompt) - 1, block_size)``, for the lookup, the store and the
  load alike;
* its key is ``request.block_hashes[count // block_size - 1].hex()`` (the scheduler's
  hash block is its block here: one full-attention group), recorded in
  ``update_state_after_alloc`` for every admitted request and carried by the records
  (:class:`KeyedReqMeta`, ``storage_key``); a lookup or a store is skipped when there is
  no full block to key on;
* ``get_num_new_matched_tokens`` answers ``max(0, count - num_computed_tokens)`` (a
  local hit longer than the count is never a negative match).

The connector's worker half (``start_load_kv``, ``save_kv_layer``) is not run here: the
adapter plays the worker, and :class:`VllmExample53495FixedAdapter` joins a record's key
to the storage path (:meth:`ExampleConnector53495Fixed.folder_of`), which is what the
fix's worker does.

How it matches the tracker: the issue's reproduction (request A with one salt stored,
request B with the same prompt and another salt matched 48 tokens, three of A's blocks;
the same across two LoRA adapters) is the suite's ``keys-cache-salt`` and ``keys-lora``
scenarios: B (salt t1) and A (no salt) store one folder in step 0, C (salt t2) arrives
later and, with the installed connector, is handed the folder's 8 tokens (PREFIX, rule
``key-domains``: C reads K/V computed under salt t1). With this module C misses, and D
(salt t1 again) hits B's blocks in the local prefix cache.

The module refuses to import (:func:`refserve.conformance.corpus.hunk.require_lines`)
unless the installed connector still keys on the prompt's tokens and never on block
hashes: the fix is written against that code.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from refserve.conformance.adapters import vllm_example as released
from refserve.conformance.corpus.hunk import require_lines

BUGGY = "refserve.conformance.adapters.vllm_example:make"
FIXED = "refserve.conformance.corpus.patches.vllm_53495_fixed:make"

_example: Any = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
)
_torch: Any = importlib.import_module("torch")

require_lines(
    "vllm#53495's fix",
    _example.ExampleConnector,
    (
        "list(request.prompt_token_ids or [])",
        "if not self._found_match_for_prompt(token_ids, mm_hashes):",
        "token_bytes = token_ids.numpy().tobytes()",
    ),
    absent=("block_hashes",),
)


@dataclass
class KeyedReqMeta:
    """A load or store record that carries its storage key (the fix's ``ReqMeta``)."""

    token_ids: Any
    slot_mapping: Any
    is_store: bool
    mm_hashes: list[str]
    storage_key: str


@dataclass
class KeyedMetadata(_example.KVConnectorMetadata):  # type: ignore[misc]
    requests: list[KeyedReqMeta]


class ExampleConnector53495Fixed(_example.ExampleConnector):  # type: ignore[misc]
    """``ExampleConnector`` whose storage key is the request's block hash."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._keys: dict[str, tuple[str, int]] = {}  # request id -> (key, tokens)

    def _count(self, request: Any) -> int:
        """The tokens a record covers: the installed lookup's count."""
        n = len(request.prompt_token_ids or [])
        return max(0, int(_example.align_to_block_size(n - 1, self._block_size)))

    def _key(self, request: Any) -> tuple[str, int] | None:
        count = self._count(request)
        blocks = count // self._block_size
        if blocks == 0 or len(request.block_hashes) < blocks:
            return None
        return bytes(request.block_hashes[blocks - 1]).hex(), count

    def folder_of(self, key: str, create: bool) -> str:
        folder = os.path.join(self._storage_path, key)
        if create:
            os.makedirs(folder, exist_ok=True)
        return folder

    def _found_match_for_request(self, request: Any) -> bool:
        keyed = self._key(request)
        return keyed is not None and os.path.exists(self.folder_of(keyed[0], create=False))

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._found_match_for_request(request):
            return 0, False
        return max(0, self._count(request) - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        keyed = self._key(request)
        if keyed is not None:
            self._keys[request.request_id] = keyed
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _record(
        self, token_ids: list[int], block_ids: list[int], is_store: bool, mm: list[str], key: str
    ) -> KeyedReqMeta:
        count, bs = len(token_ids), self._block_size
        slots = [b * bs + o for b in block_ids for o in range(bs)][:count]
        return KeyedReqMeta(
            token_ids=_torch.tensor(token_ids, dtype=_torch.long),
            slot_mapping=_torch.tensor(slots, dtype=_torch.long),
            is_store=is_store,
            mm_hashes=mm,
            storage_key=key,
        )

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        records: list[KeyedReqMeta] = []
        for new_req in scheduler_output.scheduled_new_reqs:
            keyed = self._keys.pop(new_req.req_id, None)
            if keyed is None:
                continue
            key, count = keyed
            tokens = list(new_req.prompt_token_ids or [])[:count]
            mm = [f.identifier for f in new_req.mm_features]
            load = new_req.req_id in self._requests_need_load
            if load or not os.path.exists(self.folder_of(key, create=False)):
                records.append(self._record(tokens, new_req.block_ids[0], not load, mm, key))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in cached.resumed_req_ids or req_id not in self._requests_need_load:
                continue
            keyed = self._keys.pop(req_id, None)
            request = self._requests_need_load[req_id]
            if keyed is None or cached.new_block_ids[i] is None:
                continue
            key, count = keyed
            mm = [f.identifier for f in request.mm_features]
            tokens = list(request.all_token_ids[:count])
            records.append(self._record(tokens, cached.new_block_ids[i][0], False, mm, key))
        self._requests_need_load.clear()
        return KeyedMetadata(requests=records)


class VllmExample53495FixedAdapter(released.VllmExampleAdapter):
    """The ``ExampleConnector`` adapter whose connector keys on block hashes."""

    connector_class = "ExampleConnector53495Fixed"
    connector_module = __name__

    @property
    def name(self) -> str:
        return f"{super().name} [vllm#53495 fix (PR 53496, unmerged) applied]"

    def storage_folder(self, record: Any, create: bool) -> str:
        return str(self._sched.connector.folder_of(record.storage_key, create))


def make() -> VllmExample53495FixedAdapter:
    """Factory for ``--adapter refserve.conformance.corpus.patches.vllm_53495_fixed:make``."""
    return VllmExample53495FixedAdapter()
