"""Adapter for vLLM 0.33.0's V1 scheduler (``refserve.conformance.adapters.vllm:make``); optional.

Install and run: ``make conformance-vllm`` (its own virtualenv ``.venv-vllm``, never
refserve's). The adapter drives ``vllm.v1.core.sched.scheduler.Scheduler`` and the
``KVCacheManager`` / ``BlockPool`` it builds, in-process, on the CPU, without a model,
weights or a GPU: the ``VllmConfig`` is built from a tiny Llama ``config.json`` the
adapter writes to a temporary directory (no tokenizer, no weights) and a CPU device
config, and the ``KVCacheConfig`` is one full-attention group of ``num_blocks + 1``
blocks. The suite plays the model runner: ``commit`` hands the sampled tokens to
``Scheduler.update_from_output`` in a ``ModelRunnerOutput``. Nothing of vLLM is copied
or patched. Its conventions are declared in :data:`VLLM_PROPERTIES` (fcfs_strict) and
:data:`VLLM_PRIORITY_PROPERTIES` (priority policy).

How vLLM's state maps onto the protocol (the adapter translates, it never fixes):

* **The null block.** ``BlockPool`` takes block 0 out of the free queue at start-up as a
  placeholder (``null_block``) that never holds K/V in a full-attention model. The
  adapter asks for ``num_blocks + 1`` blocks (vLLM's own start-up check likewise plans
  against ``num_blocks - 1`` usable blocks) and reports vLLM block ``b`` as block
  ``b - 1``; a slot ``s`` of vLLM's address space is reported as ``s - block_size``. A
  consistent relabelling: nothing is recomputed, and a null block in a table would show
  as block ``-1`` (a malformed record, reported).
* **max_model_len.** vLLM refuses to start an engine whose pool cannot hold one
  ``max_model_len`` sequence (``kv_cache_planning.check_enough_kv_cache_memory``); with
  ``max_model_len=-1`` it fits ``max_model_len`` to the pool instead
  (``_auto_fit_max_model_len``: the longest length whose blocks fit, ``num_blocks *
  block_size``). The suite's default ``max_model_len`` is far larger than its pools, so
  the adapter configures vLLM's auto-fit: ``min(config.max_model_len, num_blocks *
  block_size)``, reported in ``RequestSnapshot.max_model_len``. A request vLLM stops
  there (``FINISHED_LENGTH_CAPPED``) is reported with vLLM's reason, ``length``, even
  before its ``max_tokens``: the declared property ``max_model_len_stop``
  (conformance/FINDINGS_vllm.md, finding 1, withdrawn). Prompts are
  validated by vLLM's own ``InputProcessor._validate_prompt_len`` (empty, or not
  shorter than ``max_model_len``: ``Rejected``).
* **Positions and slots** are what vLLM's model runner derives from the
  ``SchedulerOutput``: positions ``num_computed_tokens .. + num_scheduled_tokens`` (the
  ``num_computed_tokens`` the output carries for each request), and slots from the
  runner's own per-request block table, built only from the output as the runner builds
  it (``NewRequestData.block_ids`` for a new request; ``CachedRequestData.new_block_ids``
  appended, or replacing the table for a request in ``resumed_req_ids``; dropped for
  ``finished_req_ids`` and ``preempted_req_ids``), with the runner's slot arithmetic
  (``ComputeSlotMappingKernel``: ``table[pos // bs] * bs + pos % bs``). A position past
  the end of that table gets no slot (the kernel would read outside the row). The
  ``samples`` flag is the runner's: a request samples when its chunk reaches
  ``num_tokens`` (partial prefills get an empty ``sampled_token_ids`` entry, as the
  runner discards their tokens).
* **KV length** is ``Request.num_computed_tokens`` at a step boundary (vLLM advances it
  when it schedules; after ``update_from_output`` it counts the K/V written). A
  ``RUNNING`` request is ``decoding`` when it equals ``num_tokens - 1``, else
  ``prefilling``; ``PREEMPTED`` is ``preempted``; ``WAITING`` is ``waiting``.
* **Preemptions** are vLLM's own ``SchedulerOutput.preempted_req_ids``, plus any request
  that held blocks before ``schedule()`` and is ``PREEMPTED`` after it.
* **Tables** are ``req_to_blocks`` of vLLM's single-type manager, for every request id
  that holds blocks there (a finished request that still held some would show). The
  pool's ref counts are ``KVCacheBlock.ref_cnt`` and the free queue is
  ``FreeKVCacheBlockQueue`` walked from its head (the order ``popleft_n`` hands out).
* **The prefix cache** is keyed by vLLM's own hashes (sha256 over the parent hash, the
  tokens and extra keys), not by the spec's hash chain: ``cache_entries`` stays empty and
  ``cache_index`` is off (PREFIX is checked through sharing, writes and the KV read-back).
  The hashes come from the block hasher ``EngineCore`` builds
  (``get_request_block_hasher``), which each ``Request`` runs on its own tokens; the
  adapter builds it in :meth:`VllmAdapter.make_block_hasher`, the hook a corpus patch
  overrides (conformance/corpus/patches/vllm_44701.py).
* **Key domains** (features ``cache_salt`` and ``lora``). ``RequestSpec.cache_salt`` is
  ``Request(cache_salt=...)`` (``None`` for ``""``, as vLLM's inputs leave it unset).
  ``RequestSpec.lora`` is ``Request(lora_request=LoRARequest(name, id, path))`` (``None``
  for ``""``, the base model): the id is a stable int per adapter name within one adapter
  instance (1, 2, ... in first-seen order; ``LoRARequest`` refuses ids below 1), and the
  path is made up from the name, :data:`LORA_PATH_ROOT` ``+ "/" + name``, so one name
  never points at two paths. vLLM's scheduler side only hashes the two:
  ``generate_block_hash_extra_keys`` puts ``("lora", name, path)`` into every block's
  extra keys and ``("cache_salt", salt)`` into block 0's. No adapter is ever loaded and
  vLLM's LoRA config stays off, so neither the ``max_loras`` admission limit of a
  LoRA-enabled scheduler nor the input processor's ``_validate_lora`` (which refuses a
  LoRA request without that config; the adapter calls only ``_validate_prompt_len``) is
  in play. Every table's ``root_key`` is ``RequestSpec.namespace.root_key()``: the
  identity the request was submitted with (vLLM keeps no root key of its own), so PREFIX
  can tell the domains of two tables that share a block.
* **Speculative decoding** (feature ``speculative_decoding``). A configuration with
  ``num_speculative_tokens`` k > 0 runs vLLM with ``SpeculativeConfig(method="ngram",
  num_speculative_tokens=k)``: the scheduler side of a proposer that runs in the
  worker (no draft model, no lookahead slots, no extra drafting slots in the budget;
  the worker, which the suite plays, proposes). ``propose`` is what ``EngineCore`` does
  with the drafter's output: ``Scheduler.update_draft_token_ids``, which sets
  ``Request.spec_token_ids``. The next ``schedule()`` verifies as many as the budget
  and ``max_model_len`` allow; ``ScheduledRequest.num_draft_tokens`` is the length of
  that request's ``SchedulerOutput.scheduled_spec_decode_tokens`` entry (its positions
  and slots are among the step's, as the runner gets them). ``commit(sampled,
  accepted)`` gives ``update_from_output`` what the rejection sampler returns: the
  accepted drafts, then the sampled token, in ``sampled_token_ids``; vLLM lowers
  ``num_computed_tokens`` by the rejected ones itself and keeps their blocks, so a
  table may hold up to k slots past its KV length: the adapter declares
  ``lookahead_slots`` k (plus vLLM's ``num_lookahead_tokens``, 0 for n-gram) for such a
  configuration, 0 otherwise, in ``properties`` once configured.
* Not available in vLLM's scheduler: rollback (``schedule()`` commits its allocations,
  cache entries and counters at once), a per-request eos token id (one eos per model,
  from its generation config), swapping.

Factories: :func:`make` (fcfs, chunked prefill on, vLLM's defaults otherwise),
:func:`make_priority` (``policy="priority"``, ``RequestSpec.priority`` honoured),
:func:`make_unchunked` (``enable_chunked_prefill=False``) and :func:`make_first_chunk`
(``scheduler_reserve_full_isl=False``: admission checks only the first chunk).

vLLM is imported when this module is imported (it takes about 15 s, too long for the
suite's per-call timeout), so a missing or different vLLM makes the module import fail
with :class:`ModuleNotFoundError` / :class:`VllmVersionError` and ``refserve conformance
--adapter refserve.conformance.adapters.vllm:make`` exits 2 with that one line.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from types import SimpleNamespace
from typing import Any

from refserve.conformance.adapter import (
    AdmissionOrder,
    CommitReport,
    EngineConfig,
    EngineProperties,
    Feature,
    NotSupported,
    Rejected,
    RequestSpec,
    StepOrder,
    StepReport,
)
from refserve.spec.hashing import DEFAULT_NAMESPACE
from refserve.spec.snapshot import (
    EngineSnapshot,
    PoolSnapshot,
    RequestSnapshot,
    RequestStatus,
    ScheduledRequest,
    TableSnapshot,
)

VLLM_VERSION = "0.33.0"
"""The vLLM release this adapter was written against (read from its source)."""


class VllmVersionError(ImportError):
    """The installed vLLM is not the release this adapter translates (:data:`VLLM_VERSION`)."""


def check_installed(
    adapter: str = "refserve.conformance.adapters.vllm",
    changes: str = "its scheduler's internals change between releases",
) -> None:
    """Refuse early, without importing vLLM: absent, or another release (each vLLM
    adapter, naming itself and what it reads that changes between releases)."""
    if importlib.util.find_spec("vllm") is None:
        # ModuleNotFoundError, so pytest.importorskip and `except ImportError` both work.
        raise ModuleNotFoundError(
            f"vLLM is not installed here (the adapter needs vllm=={VLLM_VERSION} in its "
            "own virtualenv: make conformance-vllm)",
            name="vllm",
        )
    try:
        found = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        found = "unknown"
    if found != VLLM_VERSION:
        raise VllmVersionError(
            f"vLLM {found} is installed; {adapter} translates vLLM {VLLM_VERSION} only ({changes})"
        )


@dataclass(frozen=True)
class _Vllm:
    """The vLLM names the adapter uses (vLLM ships no type information: Any here)."""

    version: str
    torch: Any
    ModelConfig: Any
    CacheConfig: Any
    SchedulerConfig: Any
    DeviceConfig: Any
    VllmConfig: Any
    SpeculativeConfig: Any
    Scheduler: Any
    KVCacheConfig: Any
    KVCacheGroupSpec: Any
    FullAttentionSpec: Any
    StructuredOutputManager: Any
    Request: Any
    VStatus: Any
    SamplingParams: Any
    ModelRunnerOutput: Any
    DraftTokenIds: Any
    InputProcessor: Any
    ClientError: Any
    LoRARequest: Any
    get_request_block_hasher: Any
    init_none_hash: Any
    get_hash_fn_by_name: Any
    resolve_kv_cache_block_sizes: Any


def _import_vllm() -> _Vllm:
    check_installed()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    vllm = importlib.import_module("vllm")
    # Its config warnings (tiny budgets, a CPU device) would drown the suite's output.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    if vllm.__version__ != VLLM_VERSION:
        raise VllmVersionError(
            f"vllm.__version__ is {vllm.__version__}; refserve.conformance.adapters.vllm "
            f"translates vLLM {VLLM_VERSION} only"
        )
    config = importlib.import_module("vllm.config")
    sched = importlib.import_module("vllm.v1.core.sched.scheduler")
    iface = importlib.import_module("vllm.v1.kv_cache_interface")
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    request = importlib.import_module("vllm.v1.request")
    return _Vllm(
        version=str(vllm.__version__),
        torch=importlib.import_module("torch"),
        ModelConfig=config.ModelConfig,
        CacheConfig=config.CacheConfig,
        SchedulerConfig=config.SchedulerConfig,
        DeviceConfig=config.DeviceConfig,
        VllmConfig=config.VllmConfig,
        SpeculativeConfig=config.SpeculativeConfig,
        Scheduler=sched.Scheduler,
        KVCacheConfig=iface.KVCacheConfig,
        KVCacheGroupSpec=iface.KVCacheGroupSpec,
        FullAttentionSpec=iface.FullAttentionSpec,
        StructuredOutputManager=importlib.import_module(
            "vllm.v1.structured_output"
        ).StructuredOutputManager,
        Request=request.Request,
        VStatus=request.RequestStatus,
        SamplingParams=importlib.import_module("vllm.sampling_params").SamplingParams,
        ModelRunnerOutput=importlib.import_module("vllm.v1.outputs").ModelRunnerOutput,
        DraftTokenIds=importlib.import_module("vllm.v1.outputs").DraftTokenIds,
        InputProcessor=importlib.import_module("vllm.v1.engine.input_processor").InputProcessor,
        ClientError=importlib.import_module("vllm.exceptions").VLLMClientError,
        LoRARequest=importlib.import_module("vllm.lora.request").LoRARequest,
        get_request_block_hasher=utils.get_request_block_hasher,
        init_none_hash=utils.init_none_hash,
        get_hash_fn_by_name=importlib.import_module("vllm.utils.hashing").get_hash_fn_by_name,
        resolve_kv_cache_block_sizes=utils.resolve_kv_cache_block_sizes,
    )


# A tiny Llama: the scheduler reads only the model's length limits, its eos and that it
# is a decoder-only generative text model. No weights, no tokenizer are ever loaded.
MAX_POSITIONS = 1 << 22
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 1 << 20,
    "max_position_embeddings": MAX_POSITIONS,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def _base_model_config(v: _Vllm) -> Any:
    """One ``ModelConfig`` per process (building one costs seconds); copied per configure."""
    model_dir = tempfile.mkdtemp(prefix="refserve-vllm-model-")
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(TINY_LLAMA, f)
    return v.ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        max_model_len=MAX_POSITIONS,
        dtype="float32",
        seed=0,
        generation_config="vllm",  # vLLM's defaults, not a generation_config.json
    )


V = _import_vllm()
BASE_MODEL_CONFIG = _base_model_config(V)

ROOT = DEFAULT_NAMESPACE.root_key()
NULL_BLOCKS = 1  # vLLM's BlockPool reserves block 0 as its null block
LORA_PATH_ROOT = "/nonexistent/refserve-conformance/lora"
"""Where the made-up ``LoRARequest.lora_path`` of adapter ``name`` points
(``LORA_PATH_ROOT + "/" + name``): vLLM requires a path and hashes it with the name, and
the scheduler never loads it."""


# vLLM's conventions, read from vllm/v1/core/sched/scheduler.py, kv_cache_manager.py,
# single_type_kv_cache_manager.py, block_pool.py and kv_cache_utils.py (0.33.0):
# * lookahead_slots 0: ``allocate_slots`` allocates for ``num_computed_tokens +
#   num_new_tokens + num_lookahead_tokens`` and ``num_lookahead_tokens`` is 0 without
#   speculative decoding, so at a step boundary a table holds ceil(kv / bs) blocks
#   (``configure`` declares the draft count for a speculative configuration: the
#   blocks of rejected drafts stay, see the module docstring).
# * eos: ``check_stop`` finishes a request whose last token is ``sampling_params
#   .eos_token_id`` (set by ``update_from_generation_config`` unless ``ignore_eos``),
#   or one of ``stop_token_ids``; then ``max_tokens`` / ``max_model_len``.
# * admission: ``waiting`` is a FCFS deque (a heap by (priority, arrival_time,
#   request_id) under ``policy="priority"``); the waiting loop looks at its head and
#   ``break``s at the first request whose allocation fails (head-of-line blocking; no
#   request is skipped in this setting: the skip paths are for grammars, remote KV,
#   LoRA, encoders and Mamba), so the strict orders are declared (fcfs_strict and
#   priority_strict: the sampled suite and the exhaustive small scope pass them). No
#   waiting request is admitted in a step that preempted.
#   Preempted requests go back to the front (``prepend_request``), which ORDER leaves
#   to the engine.
# * decode-first: ``schedule`` serves ``self.running`` (decodes and running prefill
#   chunks) before the waiting queue, with mixed batches.
# * same_step_prefix_hits: ``allocate_slots`` calls ``cache_blocks`` for the blocks it
#   allocates (``num_tokens_to_cache`` includes this step's tokens), so a request
#   admitted later in the same ``schedule()`` hits a block an earlier one fills in that
#   step. Safe with vLLM's executor: each attention layer writes the whole batch's K/V
#   (``reshape_and_cache``) before its attention reads the cache.
# * free_queue_order: ``FreeKVCacheBlockQueue`` is a doubly linked list; ``popleft_n``
#   hands blocks out from its head; freed uncached blocks are prepended, freed cached
#   ones appended (LRU eviction), and a cache hit takes a block out of the middle.
# * max_model_len_stop: ``check_stop`` (vllm/v1/core/sched/utils.py) finishes a request
#   with ``FINISHED_LENGTH_CAPPED`` when ``num_tokens >= max_model_len``, checked with
#   ``max_tokens`` after eos and the stop token ids; the limit is the one this adapter
#   fits to the pool and reports in every RequestSnapshot.
VLLM_PROPERTIES = EngineProperties(
    lookahead_slots=0,
    eos=True,
    admission_order=AdmissionOrder.FCFS_STRICT,
    step_order=StepOrder.DECODE_FIRST,
    same_step_prefix_hits=True,
    free_queue_order=True,
    max_model_len_stop=True,
)
VLLM_PRIORITY_PROPERTIES = EngineProperties(
    lookahead_slots=0,
    eos=True,
    admission_order=AdmissionOrder.PRIORITY_STRICT,
    step_order=StepOrder.DECODE_FIRST,
    same_step_prefix_hits=True,
    free_queue_order=True,
    max_model_len_stop=True,
)

_REASONS = {
    "FINISHED_STOPPED": "stop",
    "FINISHED_LENGTH_CAPPED": "length",
    "FINISHED_ABORTED": "abort",
    "FINISHED_IGNORED": "ignored",
    "FINISHED_ERROR": "error",
    "FINISHED_REPETITION": "repetition",
}


def _reason_of(e: Exception) -> str:
    """The message of a (pydantic) validation error, without pydantic's decoration."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            return "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in errors())
        except (TypeError, KeyError):
            pass
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@dataclass(frozen=True)
class SchedulerChoices:
    """How the adapter runs vLLM's scheduler, besides the EngineConfig."""

    policy: str
    chunked_prefill: bool
    reserve_full_isl: bool


@dataclass(frozen=True)
class BuiltScheduler:
    """vLLM's scheduler for one EngineConfig, with the configs it was built from."""

    scheduler: Any
    vllm_config: Any
    model_config: Any
    max_model_len: int
    hash_block_size: int


def build_scheduler(
    config: EngineConfig,
    choices: SchedulerChoices,
    kv_transfer_config: Callable[[], Any],
    speculative_config: Callable[[], Any],
) -> BuiltScheduler:
    """vLLM's configs for ``config`` and the scheduler built on them, as the engine core
    builds them after profiling (``NotSupported`` when vLLM refuses the configuration)."""
    bs, n = config.block_size, config.num_blocks
    # vLLM's auto-fit (max_model_len=-1): the longest sequence the pool can hold.
    max_model_len = min(config.max_model_len, n * bs)
    model_config = copy.copy(BASE_MODEL_CONFIG)
    model_config.max_model_len = max_model_len
    try:
        cache = V.CacheConfig(
            block_size=bs,
            num_gpu_blocks_override=n + NULL_BLOCKS,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        scheduler = V.SchedulerConfig(
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            enable_chunked_prefill=choices.chunked_prefill,
            policy=choices.policy,
            async_scheduling=False,
            scheduler_reserve_full_isl=choices.reserve_full_isl,
        )
        vllm_config = V.VllmConfig(
            model_config=model_config,
            cache_config=cache,
            scheduler_config=scheduler,
            device_config=V.DeviceConfig("cpu"),
            kv_transfer_config=kv_transfer_config(),
            speculative_config=speculative_config(),
        )
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        raise NotSupported(f"vLLM refuses this configuration: {_reason_of(e)}") from e
    # What the engine core does after profiling: the pool size it settled on.
    vllm_config.cache_config.num_gpu_blocks = n + NULL_BLOCKS
    kv_cache_config = V.KVCacheConfig(
        num_blocks=n + NULL_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            V.KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"],
                V.FullAttentionSpec(
                    block_size=bs, num_kv_heads=1, head_size=32, dtype=V.torch.float32
                ),
            )
        ],
    )
    sched_bs, hash_bs = V.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    sched = V.Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=V.StructuredOutputManager(vllm_config),
        block_size=sched_bs,
        hash_block_size=hash_bs,
    )
    return BuiltScheduler(sched, vllm_config, model_config, max_model_len, hash_bs)


class VllmAdapter:
    """vLLM's V1 Scheduler + KVCacheManager behind the conformance protocol."""

    def __init__(
        self,
        *,
        policy: str = "fcfs",
        chunked_prefill: bool = True,
        reserve_full_isl: bool = True,
        speculation: bool = True,
    ) -> None:
        self._policy = policy
        self._chunked = chunked_prefill
        self._reserve_full_isl = reserve_full_isl
        self._speculation = speculation
        self._num_spec_tokens = 0  # the configured engine's num_speculative_tokens
        self.properties = VLLM_PRIORITY_PROPERTIES if policy == "priority" else VLLM_PROPERTIES
        self._sched: Any = None
        self._cfg: EngineConfig | None = None
        self._max_model_len = 0
        self._model_config: Any = None
        self._hasher: Any = None
        self._lora_ids: dict[str, int] = {}  # adapter name -> LoRARequest.lora_int_id
        self._root_keys: dict[str, bytes] = {}  # request id -> the root key it was submitted with
        self._all: dict[str, Any] = {}  # request id -> vLLM Request, every one submitted
        self._live: dict[str, Any] = {}  # request id -> vLLM Request, not finished
        self._max_tokens: dict[str, int] = {}
        self._arrival: dict[str, int] = {}
        self._cached: dict[str, int] = {}  # prompt tokens served by the cache at admission
        self._ran: set[str] = set()
        self._retired: list[tuple[str, RequestStatus]] = []
        self._runner_tables: dict[str, list[int]] = {}  # the model runner's block tables
        self._pending: Any = None  # the SchedulerOutput awaiting commit
        self._samples: dict[str, bool] = {}
        self._clock = 0

    @property
    def name(self) -> str:
        extra = [] if self._policy == "fcfs" else [f"policy={self._policy}"]
        if not self._chunked:
            extra.append("no chunked prefill")
        if not self._reserve_full_isl:
            extra.append("scheduler_reserve_full_isl=False")
        suffix = f" ({', '.join(extra)})" if extra else ""
        return f"vLLM {V.version} V1 scheduler{suffix}"

    @property
    def features(self) -> frozenset[Feature]:
        f = {
            Feature.PREFIX_CACHING,
            Feature.PREFIX_CACHING_OPTIONAL,
            Feature.PREEMPTION,
            Feature.ABORT,
            Feature.STOP_TOKEN_IDS,
            Feature.CACHE_SALT,
            Feature.LORA,
        }
        if self._chunked:
            f.add(Feature.CHUNKED_PREFILL)
        if self._policy == "priority":
            f.add(Feature.PRIORITIES)
        if self._speculation:
            f.add(Feature.SPECULATIVE_DECODING)
        return frozenset(f)

    # ------------------------------------------------------------------ setup
    def configure(self, config: EngineConfig) -> None:
        if config.num_speculative_tokens and not self._speculation:
            raise NotSupported("this adapter runs vLLM without a speculative config")
        built = build_scheduler(
            config,
            SchedulerChoices(self._policy, self._chunked, self._reserve_full_isl),
            lambda: self.kv_transfer_config(config),
            lambda: self.speculative_config(config),
        )
        self._sched, vllm_config = built.scheduler, built.vllm_config
        # As EngineCore.__init__: a block hasher only when prefix caching is on or a KV
        # connector is configured (the connector keys its transfers by block hash).
        self._hasher = None
        if config.enable_prefix_caching or vllm_config.kv_transfer_config is not None:
            hash_fn = V.get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
            V.init_none_hash(hash_fn)
            self._hasher = self.make_block_hasher(
                built.hash_block_size, hash_fn, vllm_config.num_hash_lookahead_tokens
            )
        self._cfg = config
        self._max_model_len = built.max_model_len
        self._num_spec_tokens = int(vllm_config.num_speculative_tokens)
        # The slots a table may hold past its KV length: with speculation, the blocks
        # of rejected drafts stay with the request (update_from_output only lowers
        # num_computed_tokens), up to num_speculative_tokens of them, plus the
        # lookahead slots allocate_slots adds for a drafter with its own forward pass.
        lookahead = (
            self._num_spec_tokens + int(vllm_config.num_lookahead_tokens)
            if self._num_spec_tokens
            else 0
        )
        # With drafts, a request admitted with one token left to compute is padded to
        # 1 + k tokens with placeholder drafts (-1) when no prefill chunk runs in the
        # step (schedule(): pad_spec_decode, uniform batches for CUDA graphs); the
        # rejection sampler rejects them.
        self.properties = dataclasses.replace(
            self.properties,
            lookahead_slots=lookahead,
            placeholder_drafts=bool(self._num_spec_tokens),
        )
        self._model_config = built.model_config
        self._root_keys.clear()
        self._all.clear()
        self._live.clear()
        self._max_tokens.clear()
        self._arrival.clear()
        self._cached.clear()
        self._ran.clear()
        self._retired = []
        self._runner_tables.clear()
        self._pending = None
        self._samples = {}
        self._clock = 0

    def kv_transfer_config(self, config: EngineConfig) -> Any:
        """The ``KVTransferConfig`` the engine runs with: ``None``, no KV connector (a
        connector mode overrides it: conformance/adapters/vllm_offload.py)."""
        del config
        return None

    def speculative_config(self, config: EngineConfig) -> Any:
        """The ``SpeculativeConfig`` the engine runs with: ``None`` without drafts, else
        the n-gram proposer's (``method="ngram"``) with the configuration's
        ``num_speculative_tokens``. The proposer itself runs in the worker, which the
        suite plays: it hands vLLM the suite's drafts as ``EngineCore`` hands the
        drafter's (``Scheduler.update_draft_token_ids``, :meth:`propose`); the n-gram
        method is the one whose scheduler side adds nothing else (no lookahead slots,
        no extra drafting slots in the budget)."""
        if not config.num_speculative_tokens:
            return None
        return V.SpeculativeConfig(
            method="ngram", num_speculative_tokens=config.num_speculative_tokens
        )

    def runner_output_extras(self, out: Any) -> dict[str, Any]:
        """Fields of the step's ``ModelRunnerOutput`` besides the sampled tokens (the
        worker side of a KV connector reports through ``kv_connector_output``); none
        without a connector."""
        del out
        return {}

    def make_block_hasher(
        self, hash_block_size: int, hash_fn: Any, num_hash_lookahead_tokens: int
    ) -> Any:
        """The per-request block hasher, as ``EngineCore.__init__`` builds it."""
        return V.get_request_block_hasher(hash_block_size, hash_fn, num_hash_lookahead_tokens)

    def _lora_request(self, name: str) -> Any:
        """vLLM's ``LoRARequest`` for adapter ``name`` (``None``: the base model)."""
        if not name:
            return None
        lora_id = self._lora_ids.setdefault(name, len(self._lora_ids) + 1)
        return V.LoRARequest(name, lora_id, f"{LORA_PATH_ROOT}/{name}")

    @property
    def scheduler(self) -> Any:
        """The vLLM Scheduler this adapter drives (the bench times it directly)."""
        return self._sched

    @property
    def cfg(self) -> EngineConfig:
        if self._cfg is None:
            raise NotSupported("configure() was not called")
        return self._cfg

    def add_request(self, request: RequestSpec) -> None:
        cfg = self.cfg
        if request.eos_token_id not in (None, cfg.eos_token_id):
            raise NotSupported("vLLM has one eos token id per model (its generation config)")
        prompt = list(request.prompt_token_ids)
        # vLLM's own submission checks (InputProcessor): prompt length, sampling params.
        checker = SimpleNamespace(
            skip_prompt_length_check=False,
            model_config=self._model_config,
            supports_mm_inputs=False,
            mm_encoder_cache_size=0,
        )
        try:
            V.InputProcessor._validate_prompt_len(checker, len(prompt), "decoder")
            params = V.SamplingParams.from_optional(
                max_tokens=request.max_tokens,
                stop_token_ids=list(request.stop_token_ids),
            )
        except (ValueError, V.ClientError) as e:  # VLLMValidationError: a VLLMClientError
            raise Rejected(f"{type(e).__name__}: {e}") from e
        params.update_from_generation_config({}, cfg.eos_token_id)
        self._clock += 1
        req = V.Request(
            request_id=request.request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(self._clock),
            priority=request.priority,
            lora_request=self._lora_request(request.lora),
            cache_salt=request.cache_salt or None,
            block_hasher=self._hasher,
        )
        try:
            self._sched.add_request(req)
        except AssertionError as e:  # Scheduler.add_request: "duplicate request id"
            raise Rejected(f"vLLM Scheduler.add_request refused it: {e}") from e
        rid = request.request_id
        self._all[rid] = req
        self._live[rid] = req
        self._max_tokens[rid] = request.max_tokens
        self._arrival[rid] = request.arrival_step
        self._root_keys[rid] = request.namespace.root_key()

    def propose(self, request_id: str, draft_token_ids: tuple[int, ...]) -> None:
        """Drafts for the next step, as ``EngineCore`` passes the drafter's:
        ``Scheduler.update_draft_token_ids`` sets ``Request.spec_token_ids``, which the
        next ``schedule()`` verifies as far as the budget allows."""
        if not self._num_spec_tokens:
            raise NotSupported("vLLM was configured without speculative decoding")
        drafts = V.DraftTokenIds(req_ids=[request_id], draft_token_ids=[list(draft_token_ids)])
        self._sched.update_draft_token_ids(drafts)

    def abort(self, request_id: str) -> None:
        aborted = self._sched.finish_requests(request_id, V.VStatus.FINISHED_ABORTED)
        if request_id in self._live and any(r.request_id == request_id for r in aborted):
            self._live.pop(request_id)
            self._retired.append((request_id, RequestStatus.ABORTED))

    def rollback(self) -> None:
        raise NotSupported(
            "vLLM's schedule() commits its allocations, cache entries and counters at once"
        )

    def has_unfinished(self) -> bool:
        return bool(self._sched.has_unfinished_requests())

    # ------------------------------------------------------------------ the step
    def _holds_blocks(self) -> set[str]:
        mgr = self._sched.kv_cache_manager.coordinator.single_type_managers[0]
        return {rid for rid, blocks in mgr.req_to_blocks.items() if blocks}

    def _runner_update(self, out: Any) -> dict[str, int]:
        """The model runner's view of the step: its block tables and each start position."""
        for rid in (*out.finished_req_ids, *out.preempted_req_ids):
            self._runner_tables.pop(rid, None)
        start: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self._runner_tables[new.req_id] = [int(b) for b in new.block_ids[0]]
            start[new.req_id] = int(new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            new_ids = [int(b) for b in ids[0]] if ids is not None else []
            if rid in cached.resumed_req_ids:
                self._runner_tables[rid] = new_ids
            else:
                self._runner_tables.setdefault(rid, []).extend(new_ids)
            start[rid] = int(cached.num_computed_tokens[i])
        return start

    def schedule(self) -> StepReport:
        self._retired = []
        held = self._holds_blocks()
        out = self._sched.schedule()
        self._pending = out
        start = self._runner_update(out)
        bs = self.cfg.block_size
        admitted = {n.req_id for n in out.scheduled_new_reqs} | set(
            out.scheduled_cached_reqs.resumed_req_ids
        )
        scheduled: list[ScheduledRequest] = []
        self._samples = {}
        spec = out.scheduled_spec_decode_tokens
        for rid, n in out.num_scheduled_tokens.items():
            req = self._all[rid]
            self._ran.add(rid)
            first = start[rid]
            positions = tuple(range(first, first + int(n)))
            table = self._runner_tables.get(rid, [])
            slots = []
            for p in positions:
                if not 0 <= p // bs < len(table):
                    break  # the runner's row has no block for this position (or p < 0)
                slots.append(table[p // bs] * bs + p % bs - NULL_BLOCKS * bs)
            samples = first + int(n) >= int(req.num_tokens)
            self._samples[rid] = samples
            hit = first if rid in admitted else 0
            if rid in admitted and rid not in self._cached:
                self._cached[rid] = hit
            scheduled.append(
                ScheduledRequest(
                    request_id=rid,
                    num_new_tokens=int(n),
                    positions=positions,
                    slot_mapping=tuple(slots),
                    block_table=tuple(b - NULL_BLOCKS for b in table),
                    samples=samples,
                    num_new_cached_tokens=hit,
                    num_draft_tokens=len(spec.get(rid, ())),
                )
            )
        preempted = set(out.preempted_req_ids) | {
            rid for rid in held if self._all[rid].status == V.VStatus.PREEMPTED
        }
        copies = tuple(
            (int(c.src_block_id) - NULL_BLOCKS, int(c.dst_block_id) - NULL_BLOCKS)
            for c in (out.kv_cache_block_copies or ())
        )
        return StepReport(
            scheduled=tuple(scheduled), preempted=tuple(sorted(preempted)), block_copies=copies
        )

    def _reason(self, req: Any) -> str:
        name = str(req.status.name)
        return _REASONS.get(name, name.lower())

    def commit(
        self, sampled: Mapping[str, int], accepted: Mapping[str, int] | None = None
    ) -> CommitReport:
        """The model runner's output: per sampling request the accepted drafts (the
        first ``accepted[rid]`` of those the step verified) and the sampled token, as
        the rejection sampler lists them; vLLM rolls the rejected drafts back itself."""
        out, self._pending = self._pending, None
        if out is None:
            return CommitReport(())
        ids = list(out.num_scheduled_tokens)
        spec = out.scheduled_spec_decode_tokens
        kept = accepted or {}

        def tokens(rid: str) -> list[int]:
            if rid not in sampled:
                return []
            drafts = [int(t) for t in spec.get(rid, ())][: kept.get(rid, 0)]
            return [*drafts, int(sampled[rid])]

        runner_output = V.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[tokens(rid) for rid in ids],
            **self.runner_output_extras(out),
        )
        self._sched.update_from_output(out, runner_output)
        finished: list[tuple[str, str]] = []
        for rid in ids:
            req = self._all[rid]
            if rid in self._live and req.is_finished():
                finished.append((rid, self._reason(req)))
                self._live.pop(rid)
                self._retired.append((rid, RequestStatus.FINISHED))
        return CommitReport(tuple(finished))

    # ------------------------------------------------------------------ snapshots
    def _status(self, rid: str, req: Any) -> RequestStatus:
        st = req.status
        if st == V.VStatus.RUNNING:
            return (
                RequestStatus.DECODING
                if req.num_computed_tokens == req.num_tokens - 1
                else RequestStatus.PREFILLING
            )
        if st == V.VStatus.PREEMPTED:
            return RequestStatus.PREEMPTED
        if req.is_finished():
            return RequestStatus.FINISHED
        return RequestStatus.PREEMPTED if rid in self._ran else RequestStatus.WAITING

    def _request(self, rid: str, status: RequestStatus | None = None) -> RequestSnapshot:
        req = self._all[rid]
        return RequestSnapshot(
            request_id=rid,
            status=status if status is not None else self._status(rid, req),
            num_prompt_tokens=int(req.num_prompt_tokens),
            num_output_tokens=int(req.num_output_tokens),
            num_computed_tokens=int(req.num_computed_tokens),
            max_tokens=self._max_tokens[rid],
            num_cached_tokens=self._cached.get(rid, 0),
            max_model_len=self._max_model_len,
            arrival_step=self._arrival.get(rid, 0),
        )

    def snapshot(self) -> EngineSnapshot:
        pool = self._sched.kv_cache_manager.block_pool
        mgr = self._sched.kv_cache_manager.coordinator.single_type_managers[0]
        retired = dict(self._retired)
        requests = [self._request(rid) for rid in self._live if rid not in retired]
        requests += [self._request(rid, st) for rid, st in retired.items()]
        tables = []
        for rid, blocks in sorted(mgr.req_to_blocks.items()):
            if not blocks:
                continue
            req = self._all.get(rid)
            kv = int(req.num_computed_tokens) if req is not None else 0
            toks = tuple(int(t) for t in req.all_token_ids[:kv]) if req is not None else ()
            tables.append(
                TableSnapshot(
                    rid,
                    tuple(int(b.block_id) - NULL_BLOCKS for b in blocks),
                    kv,
                    toks,
                    self._root_keys.get(rid, ROOT),
                )
            )
        snap_pool = PoolSnapshot(
            num_blocks=len(pool.blocks) - NULL_BLOCKS,
            block_size=self.cfg.block_size,
            ref_cnt=tuple(int(b.ref_cnt) for b in pool.blocks[NULL_BLOCKS:]),
            free_queue=tuple(
                int(b.block_id) - NULL_BLOCKS for b in pool.free_block_queue.get_all_free_blocks()
            ),
            tables=tuple(tables),
        )
        return EngineSnapshot(tuple(sorted(requests, key=lambda r: r.request_id)), snap_pool)


def make() -> VllmAdapter:
    """Factory for ``--adapter refserve.conformance.adapters.vllm:make`` (fcfs, chunked prefill)."""
    return VllmAdapter()


def make_priority() -> VllmAdapter:
    """vLLM with ``policy="priority"``: ``RequestSpec.priority`` honoured (smaller first)."""
    return VllmAdapter(policy="priority")


def make_unchunked() -> VllmAdapter:
    """vLLM with ``enable_chunked_prefill=False``."""
    return VllmAdapter(chunked_prefill=False)


def make_first_chunk() -> VllmAdapter:
    """vLLM with ``scheduler_reserve_full_isl=False``: admission checks only the first
    chunk's blocks (not the whole prompt's), so pools fill up and preemption is common."""
    return VllmAdapter(reserve_full_isl=False)
