"""vllm#16928 fixed on vLLM 0.33.0: ``ExampleConnector`` claims no more of a stored prefix
than its save holds, so a prompt saved during a chunked prefill loads what was saved.

vLLM 0.33.0 ships the bug (the adapter :mod:`refserve.conformance.adapters.vllm_example`
runs the connector as installed), so this module is the other side of the pair: the
proposed fix, on a connector class of its own and its worker, which only this module's
factory builds. The fix is not merged.

* Tracker: https://github.com/vllm-project/vllm/issues/16928 ("SharedStorageConnector
  only see first batch of tokens": of a ~20,000-token prompt only about 2,000 tokens of
  K/V were saved; ``SharedStorageConnector`` is the connector's former name; closed as
  stale, not fixed).
* Fix proposed: https://github.com/vllm-project/vllm/pull/53314 ("ExampleConnector: cap
  external match at the saved token count"; open, not merged): the lookup claims at most
  the tokens the saved files hold (read from one layer file's safetensors header), and
  the worker injects no more than that, so the scheduler computes the rest.

The bug, as installed (``vllm/distributed/kv_transfer/kv_connector/v1/
example_connector.py``, vLLM 0.33.0):

* ``build_connector_meta`` (lines 312-387) plans a store only for
  ``scheduler_output.scheduled_new_reqs`` (line 328), i.e. in a request's first step.
  Under chunked prefill that step's ``block_ids`` are the blocks of its first chunk, and
  ``ReqMeta.make_meta`` (lines 42-65) cuts the slots to those blocks, so the save holds
  the first chunk's blocks only;
* ``get_num_new_matched_tokens`` (lines 264-299) claims, for any prompt whose folder
  exists, ``num_tokens_to_check = align_to_block_size(len(token_ids) - 1,
  self._block_size)`` (line 297) and returns ``num_tokens_to_check -
  num_computed_tokens`` (line 299): the whole prompt but its last block, whatever the
  save holds;
* the worker's ``start_load_kv`` (lines 110-198) injects the saved tensor into the
  load record's slots (line 156): a shorter tensor does not fit, and the step fails.

The fix as applied here, :class:`ExampleConnector16928Fixed` (a subclass; vLLM's class
is untouched): ``get_num_new_matched_tokens`` caps the claim at the saved token count,
the first dimension of ``kv_cache`` in the folder's first layer file (its header only,
``safe_open(...).get_slice("kv_cache").get_shape()``); the rest is the installed code.
Its worker half is the adapter's fake worker, :class:`VllmExample16928FixedAdapter`,
which copies no more than the folder holds (the PR's truncated injection) instead of
failing.

What the fix leaves: the save still covers only the first chunk, and a first chunk that
ends inside a block saves that block with positions the step did not compute; a later
load that the cap lets through reads them. The detector's chunks are whole blocks.

How it matches the tracker: the suite's ``pressure-chunked-prompt-again``: P's 14-token
prompt is computed in two chunks of a budget of 8, so its save holds 8 tokens; E evicts
it from the device; Q repeats P's prompt. The installed connector claims 12 tokens and
the load fails on the shapes (an exception out of the engine, PROGRESS); with this
module Q loads 8 and computes the rest, and every request finishes.

The module refuses to import (:func:`refserve.conformance.corpus.hunk.require_lines`)
unless the installed connector still claims the aligned prompt length from the folder's
existence alone.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from refserve.conformance.adapters import vllm_example as released
from refserve.conformance.corpus.hunk import require_lines

BUGGY = "refserve.conformance.adapters.vllm_example:make"
FIXED = "refserve.conformance.corpus.patches.vllm_16928_fixed:make"

_example: Any = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
)
_safe_open: Any = importlib.import_module("safetensors").safe_open

require_lines(
    "vllm#16928's fix",
    _example.ExampleConnector.get_num_new_matched_tokens,
    (
        "num_tokens_to_check = align_to_block_size(len(token_ids) - 1, self._block_size)",
        "return num_tokens_to_check - num_computed_tokens, False",
    ),
    absent=("safe_open", "get_slice"),
)
require_lines(
    "vllm#16928's fix",
    _example.ExampleConnector.build_connector_meta,
    ("for new_req in scheduler_output.scheduled_new_reqs:",),
)


def saved_tokens(folder: str) -> int:
    """The tokens a save holds: the rows of ``kv_cache`` in the folder's first layer
    file, read from its header (0: no file)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        return 0
    with _safe_open(os.path.join(folder, files[0]), framework="pt") as f:
        return int(f.get_slice("kv_cache").get_shape()[0])


class ExampleConnector16928Fixed(_example.ExampleConnector):  # type: ignore[misc]
    """``ExampleConnector`` whose lookup claims at most the saved tokens."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._found_match_for_request(request):
            return 0, False
        token_ids = list(request.prompt_token_ids or [])
        num_tokens_to_check = _example.align_to_block_size(len(token_ids) - 1, self._block_size)
        folder = self._generate_foldername_debug(
            _example.torch.tensor(token_ids)[:num_tokens_to_check],
            [f.identifier for f in request.mm_features],
            create_folder=False,
        )
        num_tokens_to_check = min(num_tokens_to_check, saved_tokens(folder))
        return num_tokens_to_check - num_computed_tokens, False


class VllmExample16928FixedAdapter(released.VllmExampleAdapter):
    """The ``ExampleConnector`` adapter with the fix's connector and worker."""

    connector_class = "ExampleConnector16928Fixed"
    connector_module = __name__

    @property
    def name(self) -> str:
        return f"{super().name} [vllm#16928 fix (PR 53314, unmerged) applied]"

    def load_pairs(self, held: tuple[int, ...], blocks: tuple[int, ...]) -> list[tuple[int, int]]:
        """The fix's worker injects no more than the saved tensor holds."""
        n = min(len(held), len(blocks))
        return list(zip(held[:n], blocks[:n], strict=True))


def make() -> VllmExample16928FixedAdapter:
    """Factory for ``--adapter refserve.conformance.corpus.patches.vllm_16928_fixed:make``."""
    return VllmExample16928FixedAdapter()
