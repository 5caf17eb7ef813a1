"""vLLM 0.33.0's V1 scheduler with its ``ExampleConnector`` (``vllm_example:make``); optional.

The adapter of :mod:`refserve.conformance.adapters.vllm` (the same ``Scheduler``, built
on the CPU without a model; every translation there holds here too), with vLLM's
reference KV connector on the scheduler side: the ``VllmConfig`` carries a
``KVTransferConfig`` with ``kv_connector="ExampleConnector"``, ``kv_role="kv_both"`` and
``kv_connector_extra_config={"shared_storage_path": <a fresh temporary directory>}``, so
``Scheduler.__init__`` builds ``ExampleConnector(role=KVConnectorRole.SCHEDULER)``
(``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``). Its lookup
(``get_num_new_matched_tokens``: a hit when the folder its key names exists under the
storage path), the loads and stores it plans (``build_connector_meta``) and its key are
vLLM's own. Nothing of vLLM is copied or patched.

**The connector.** ``ExampleConnector`` keeps K/V in files under the storage path, one
folder per stored prompt prefix. A new request whose prefix folder exists is a *load*:
``get_num_new_matched_tokens`` returns the prefix's tokens beyond the local hit, with
``load_kv_async`` ``False``, so the request is scheduled in the same step with those
tokens counted as computed, and the worker copies the folder's K/V into the request's
blocks before the step's forward (``start_load_kv``). A new request whose folder does not
exist is a *store*: the worker writes the K/V of its prefix's blocks during the step's
forward (``save_kv_layer``), creating the folder. Both are listed, as ``ReqMeta``
records (tokens, slots, ``is_store``), in the step's ``SchedulerOutput
.kv_connector_metadata``.

**The fake worker.** The worker side reads GPU tensors, so the adapter plays it from the
metadata, as the suite plays the model runner. A folder is a run of host blocks of the
suite's fake K/V memory (one host block per device block the record names; host block
ids are handed out in order and never reused, so a folder written again gets new ones):

* a **store** planned in step ``t`` is written by the real worker during step ``t``'s
  forward, after the step wrote its K/V. The adapter creates the folder when the step is
  committed (the connector's own folder function, ``create_folder=True``), with one file
  per attention layer, ``<layer>.safetensors``, whose ``kv_cache`` tensor has one row per
  saved token (zeros: the values live in the fake K/V memory; the scheduler side sees
  what a save leaves, the folder and the files' shapes), and reports the copy,
  ``swap_out`` (device block, host block),
  in step ``t + 1``'s report, which the fake K/V memory executes before that step's
  writes: the blocks as step ``t`` left them. A folder written twice holds the last
  write, as a file saved twice does.
* a **load** planned in step ``t`` is step ``t``'s ``swap_in`` (host block, device block):
  before the step's writes, after any store reported in the same step. The record's
  slots start at position 0, so it writes over the request's locally cached blocks too
  (vLLM's comment on the class: the example "will overwrite the existing prefix-cache in
  GPU"). A load from a folder that holds fewer blocks than the record's slots (none, or
  a shorter save) is where vLLM's worker fails: it injects the saved tensor into the
  slots and the shapes differ. The adapter raises :class:`ExampleWorkerError` (the suite
  reports an exception out of the engine); :meth:`VllmExampleAdapter.load_pairs` is the
  hook a fixed worker overrides.

Loads and stores complete within their step: no copy is in flight at a step boundary, so
``PoolSnapshot.transfers`` stays empty, and ``EngineSnapshot.host`` stays ``None`` (the
folders are a cache with no request tables).

**A request admitted with a load** is scheduled with ``num_computed_tokens`` = its local
hit + the loaded tokens. The protocol keeps them apart: ``num_new_cached_tokens`` is the
local hit (the leading blocks of its table that the prefix cache held under the same
block hash before the step), ``num_new_loaded_tokens`` the rest of its computed tokens.

**Declared conventions** are :data:`~refserve.conformance.adapters.vllm.VLLM_PROPERTIES`:
the connector never defers a lookup and never loads asynchronously, so the scheduler's
admission order is the plain one.

The worker's part is an adapter hook, :meth:`VllmExampleAdapter.storage_folder` (the
folder a ``ReqMeta`` names), so a connector whose records carry another key (a corpus
patch: conformance/corpus/patches/vllm_53495_fixed.py) brings its own.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from refserve.conformance.adapter import CommitReport, EngineConfig, StepReport
from refserve.conformance.adapters.vllm import NULL_BLOCKS, V, VllmAdapter
from refserve.spec.snapshot import ScheduledRequest

_KVTransferConfig: Any = importlib.import_module("vllm.config").KVTransferConfig
_save_file: Any = importlib.import_module("safetensors.torch").save_file
# Imported here, not at the first configure(): the connector's module pulls in attention
# code that takes seconds to import, longer than the suite gives one call.
importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.example_connector")

CONNECTOR = "ExampleConnector"


class ExampleWorkerError(RuntimeError):
    """What the real worker would meet: a load from a folder with no (or too little) K/V."""


@dataclass(frozen=True)
class _Save:
    """A store the fake worker completes when the step is committed."""

    record: Any
    """The connector's ``ReqMeta``."""
    blocks: tuple[int, ...]
    """The device blocks it reads, in the protocol's ids."""


class VllmExampleAdapter(VllmAdapter):
    """vLLM's scheduler with ``ExampleConnector`` and a fake worker side."""

    connector_class = CONNECTOR
    """The ``kv_connector`` name."""
    connector_module: str | None = None
    """The ``kv_connector_module_path`` (``None``: vLLM's registry)."""

    def __init__(self) -> None:
        super().__init__()
        self._storage: tempfile.TemporaryDirectory[str] | None = None
        self._folders: dict[str, tuple[int, ...]] = {}  # folder -> its host blocks
        self._next_host = 0
        self._saves: list[_Save] = []  # planned this step, written at commit
        self._swap_out: list[tuple[int, int]] = []  # written last step, copied this step
        self.transfers: dict[str, int] = {"stores": 0, "loads": 0, "blocks_loaded": 0}

    @property
    def name(self) -> str:
        return f"{super().name} + {self.connector_class} (scheduler side; fake worker)"

    # ------------------------------------------------------------------ setup
    def kv_transfer_config(self, config: EngineConfig) -> Any:
        del config
        if self._storage is not None:
            self._storage.cleanup()
        # Removed with the adapter (or at exit): the folders are this instance's store.
        self._storage = tempfile.TemporaryDirectory(prefix="refserve-vllm-example-")
        return _KVTransferConfig(
            kv_connector=self.connector_class,
            kv_connector_module_path=self.connector_module,
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": self._storage.name},
        )

    def configure(self, config: EngineConfig) -> None:
        super().configure(config)
        self._folders = {}
        self._next_host = 0
        self._saves = []
        self._swap_out = []
        self.transfers = {"stores": 0, "loads": 0, "blocks_loaded": 0}

    # ------------------------------------------------------------------ the fake worker
    def storage_folder(self, record: Any, create: bool) -> str:
        """The folder a ``ReqMeta`` names, as the worker computes it at save and load
        time: ``ExampleConnector``'s own function of the record's tokens and media."""
        connector = self._sched.connector
        return str(
            connector._generate_foldername_debug(
                record.token_ids, record.mm_hashes, create_folder=create
            )
        )

    def load_pairs(self, held: tuple[int, ...], blocks: tuple[int, ...]) -> list[tuple[int, int]]:
        """The copies of a load: the folder's host blocks onto the record's device blocks.
        The worker injects the saved tensor into the record's slots, so a folder holding
        fewer blocks than the record names fails on the shapes, as vLLM's worker does
        (``start_load_kv``)."""
        if len(held) < len(blocks):
            # The folder's name (a hash of the tokens) is left out: a finding names the
            # failure, not the tokens that met it.
            raise ExampleWorkerError(
                f"the worker loads {len(blocks)} block(s) of K/V from a folder that holds "
                f"{len(held)}: the saved tensor does not fit the slots"
            )
        return list(zip(held, blocks, strict=False))

    def _blocks_of(self, record: Any) -> tuple[int, ...]:
        """The device blocks a record's slots cover (whole blocks: the connector aligns
        its token counts to the block size), in the protocol's ids."""
        bs = self.cfg.block_size
        slots = [int(s) for s in record.slot_mapping]
        return tuple(slots[i] // bs - NULL_BLOCKS for i in range(0, len(slots), bs))

    def schedule(self) -> StepReport:
        pool = self._sched.kv_cache_manager.block_pool
        hashes_before = [b.block_hash for b in pool.blocks]
        report = super().schedule()
        swap_out, self._swap_out = self._swap_out, []
        swap_in: list[tuple[int, int]] = []
        loads: list[tuple[int, ...]] = []
        meta = self._pending.kv_connector_metadata
        for record in getattr(meta, "requests", ()):
            blocks = self._blocks_of(record)
            if record.is_store:
                self._saves.append(_Save(record, blocks))
                continue
            folder = self.storage_folder(record, create=False)
            pairs = self.load_pairs(self._folders.get(folder, ()), blocks)
            swap_in.extend(pairs)
            loads.append(blocks)
            self.transfers["loads"] += 1
            self.transfers["blocks_loaded"] += len(pairs)
        scheduled = tuple(self._split_hit(s, loads, hashes_before) for s in report.scheduled)
        return replace(
            report, scheduled=scheduled, swap_out=tuple(swap_out), swap_in=tuple(swap_in)
        )

    def _split_hit(
        self, s: ScheduledRequest, loads: list[tuple[int, ...]], hashes_before: list[Any]
    ) -> ScheduledRequest:
        """A request admitted with a load: its local hit is the leading blocks the prefix
        cache held under their current hash before the step; the rest of its computed
        tokens are the load's."""
        if not s.num_new_cached_tokens or not any(s.block_table[: len(lb)] == lb for lb in loads):
            return s
        pool = self._sched.kv_cache_manager.block_pool
        local = 0
        for b in s.block_table:
            before = hashes_before[b + NULL_BLOCKS]
            if before is None or pool.blocks[b + NULL_BLOCKS].block_hash != before:
                break
            local += 1
        hit = min(local * self.cfg.block_size, s.num_new_cached_tokens)
        return replace(
            s, num_new_cached_tokens=hit, num_new_loaded_tokens=s.num_new_cached_tokens - hit
        )

    def commit(
        self, sampled: Mapping[str, int], accepted: Mapping[str, int] | None = None
    ) -> CommitReport:
        report = super().commit(sampled, accepted)
        # The step's forward ran: its saves wrote their folders. The copies reach the fake
        # memory with the next step's report, before that step's writes.
        for save in self._saves:
            folder = self.storage_folder(save.record, create=True)
            self._write_layer_files(folder, len(save.record.slot_mapping))
            host = tuple(range(self._next_host, self._next_host + len(save.blocks)))
            self._next_host += len(save.blocks)
            self._folders[folder] = host
            self._swap_out.extend(zip(save.blocks, host, strict=True))
            self.transfers["stores"] += 1
        self._saves = []
        return report

    def _write_layer_files(self, folder: str, num_tokens: int) -> None:
        """The files a save leaves: one per attention layer, ``<layer>.safetensors``
        holding ``kv_cache``, a tensor with one row per saved token. The rows' contents
        stay in the fake K/V memory; the shape is what a reader of the header sees."""
        tensor = V.torch.zeros((num_tokens, 1), dtype=V.torch.float32)
        for group in self._sched.kv_cache_config.kv_cache_groups:
            for layer in group.layer_names:
                path = os.path.join(folder, f"{layer}.safetensors")
                _save_file({"kv_cache": tensor}, path)


def make() -> VllmExampleAdapter:
    """vLLM (fcfs, chunked prefill) with ``ExampleConnector`` on the scheduler side."""
    return VllmExampleAdapter()
