"""The corpus's entries: real bugs from engines' public trackers (docs/CORPUS.md).

Each symptom is said in our words from the thread; the hunks are in the patch modules'
docstrings, which cite the fixing change. Adding an entry: a patch module (or a
released version's make target), a detector of existing scenarios (add a scenario to
the library only when it is generic: a situation any engine meets, not one engine's
trace), and a row here; then ``make corpus``.
"""

from __future__ import annotations

from refserve.conformance.corpus.entry import Detector, Entry, Reproduction, Rule

NANO = "refserve.conformance.adapters.nanovllm:make"
VLLM = "refserve.conformance.adapters.vllm:make"
SGLANG_KV = "refserve.conformance.adapters.sglang_kv:make_kv"
PATCHES = "refserve.conformance.corpus.patches"

SGLANG_KV_DLLM = "refserve.conformance.adapters.sglang_kv:make_kv_dllm"
VLLM_OFFLOAD = "refserve.conformance.adapters.vllm_offload:make"
VLLM_OFFLOAD_PRIORITY = "refserve.conformance.adapters.vllm_offload:make_priority"
MODELS = "refserve.conformance.corpus.models"
LMDEPLOY = "refserve.conformance.adapters.lmdeploy:make"
VLLM_EXAMPLE = "refserve.conformance.adapters.vllm_example:make"
VLLM_OFFLOAD_OUTPUTS = "refserve.conformance.adapters.vllm_offload:make_outputs"

ENTRIES: tuple[Entry, ...] = (
    Entry(
        bug="GeeeekExplorer/nano-vllm#163",
        url="https://github.com/GeeeekExplorer/nano-vllm/issues/163",
        fix="https://github.com/GeeeekExplorer/nano-vllm/commit/f64d821c2057e2f45d0accccf5b39fd6c1438473",
        engine="nano-vllm",
        affected="upstream up to 8d63a98",
        fixed="upstream f64d821 (the fork 20260210 fixes it in deallocate)",
        symptom=(
            "A freed block handed to a new sequence keeps its old entry in the hash-to-block "
            "map. The lookup compares only the block's own tokens, so a later prompt whose "
            "block has those tokens behind another prefix is served K/V computed in another "
            "context."
        ),
        rule=Rule.KEY_DOMAINS,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-nanovllm",
        buggy=f"{PATCHES}.nanovllm_163:make",
        clean=NANO,
        detector=Detector(scenarios=("keys-refill-reversed",)),
        requires="nanovllm",
    ),
    Entry(
        bug="GeeeekExplorer/nano-vllm#144",
        url="https://github.com/GeeeekExplorer/nano-vllm/issues/144",
        fix="https://github.com/GeeeekExplorer/nano-vllm/commit/f64d821c2057e2f45d0accccf5b39fd6c1438473",
        engine="nano-vllm",
        affected="nano-vllm-fork 20260210; upstream before f64d821",
        fixed="upstream f64d821 (no release; its hunk applied to the fork)",
        symptom=(
            "A block-aligned prompt whose every block is a cache hit is admitted with zero "
            "tokens to compute: the prefill has no query token, so there is no logit to "
            "sample from, and the attention call fails on an empty sequence."
        ),
        rule=Rule.TOKEN,
        reproduction=Reproduction.RELEASED,
        environment="conformance-nanovllm",
        buggy=NANO,
        clean=f"{PATCHES}.nanovllm_144_fixed:make",
        detector=Detector(scenarios=("bug-fully-cached-prompt-concurrent",)),
        requires="nanovllm",
    ),
    Entry(
        bug="vllm-project/vllm#44701",
        url="https://github.com/vllm-project/vllm/issues/44701",
        fix="https://github.com/vllm-project/vllm/pull/44706",
        engine="vllm",
        affected="main after vllm#27211 (2025-10) until tagged keys",
        fixed="0.33.0 (tagged extra keys)",
        symptom=(
            "The LoRA adapter's name and the cache salt went into a block's extra keys as bare "
            "strings, so a request with salt X and a request on an adapter named X produced "
            "the same key for the first block: one tenant's prefix hit served K/V computed "
            "with another's adapter."
        ),
        rule=Rule.KEY_DOMAINS,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-vllm",
        buggy=f"{PATCHES}.vllm_44701:make",
        clean=VLLM,
        detector=Detector(scenarios=("keys-salt-named-like-adapter",)),
        requires="vllm",
    ),
    Entry(
        bug="vllm-project/vllm#45388",
        url="https://github.com/vllm-project/vllm/issues/45388",
        fix="https://github.com/vllm-project/vllm/pull/57841",
        engine="vllm",
        affected="0.21-0.22 with an offloading connector",
        fixed="0.33.0 (waiting requests that hold blocks get their own queue)",
        symptom=(
            "Under KV pressure with the offloading connector, a request admitted as an "
            "asynchronous load holds its blocks and waits in the one waiting queue; a "
            "request ahead of it that holds none cannot allocate, and the scan stops there "
            "every step: Running 0, Waiting N, 0 tokens per second, forever."
        ),
        rule=Rule.PROGRESS,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-vllm",
        buggy=f"{PATCHES}.vllm_45388:make",
        clean=VLLM_OFFLOAD_PRIORITY,
        detector=Detector(scenarios=("pressure-parked-load-behind-large-head",)),
        requires="vllm",
    ),
    Entry(
        bug="vllm-project/vllm#44560",
        url="https://github.com/vllm-project/vllm/pull/44560",
        fix="https://github.com/vllm-project/vllm/pull/44560",
        engine="vllm",
        affected="before the async-load reservation (2026-06)",
        fixed="0.33.0 (admission reserves what in-flight prefills and loads still need)",
        symptom=(
            "Several requests whose prefixes sit on the CPU are admitted as asynchronous "
            "loads together; each holds part of the pool, the first cannot allocate the rest "
            "of its prefill while the others hold their blocks, and none is preemptible: "
            "Running 0 forever."
        ),
        rule=Rule.PROGRESS,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-vllm",
        buggy=f"{PATCHES}.vllm_44560:make",
        clean=VLLM_OFFLOAD,
        detector=Detector(scenarios=("pressure-loads-back-at-once",)),
        requires="vllm",
    ),
    Entry(
        bug="vllm-project/vllm#57841",
        url="https://github.com/vllm-project/vllm/pull/57841",
        fix="https://github.com/vllm-project/vllm/pull/57841",
        engine="vllm",
        affected="one waiting queue with an offloading connector (fcfs)",
        fixed="0.33.0 (waiting requests that hold blocks get their own queue)",
        symptom=(
            "A request whose lookup the connector defers waits holding no block; an "
            "asynchronous load admitted behind it holds blocks; the deferred request cannot "
            "allocate and the scan stops at it every step, so the load is never promoted: "
            "nothing runs with free blocks in the pool."
        ),
        rule=Rule.PROGRESS,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-vllm",
        buggy=f"{PATCHES}.vllm_57841:make",
        clean=VLLM_OFFLOAD,
        detector=Detector(scenarios=("pressure-deferred-lookup-ahead-of-load",)),
        requires="vllm",
    ),
    Entry(
        bug="sgl-project/sglang#35270",
        url="https://github.com/sgl-project/sglang/issues/35270",
        fix="https://github.com/sgl-project/sglang/pull/35470",
        engine="sglang",
        affected="main 2026-08 (dLLM path); 0.5.23's radix cache",
        fixed="PR 35470 (open): the clean side applies it",
        symptom=(
            "A diffusion request's in-flight block was checkpointed into the radix tree while "
            "its token ids were still placeholders; the next checkpoint keyed the same page "
            "again, two tree nodes owned one page, the evictable size counted it twice, and "
            "the idle memory check stopped the server. The radix cache is SGLang's; the "
            "checkpointing call site, part of its scheduler, is played by the adapter."
        ),
        rule=Rule.STATED_FREE,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-sglang",
        buggy=f"{PATCHES}.sglang_35270:make_kv",
        clean=SGLANG_KV_DLLM,
        detector=Detector(kv_scenarios=("kv-prefix-reuse", "kv-no-space")),
        requires="sglang",
    ),
    Entry(
        bug="LMCache/LMCache#2961",
        url="https://github.com/LMCache/LMCache/issues/2961",
        fix="https://github.com/vllm-project/vllm/pull/45549",
        engine="lmcache",
        affected="LMCache 0.4.7.dev7 behind vLLM's LMCache MP connector (vLLM 0.22)",
        fixed="vLLM PR 45549 (open): the fixed model applies it",
        symptom=(
            "LMCache keyed a chunk of K/V by its tokens and the cache salt but not by the LoRA "
            "adapter, so a request on one adapter was served K/V that another adapter had "
            "computed for the same prompt, with nothing in the output to show it. A model: "
            "refserve's engine with LMCache's key."
        ),
        rule=Rule.KEY_DOMAINS,
        reproduction=Reproduction.MODEL,
        environment="",
        buggy=f"{MODELS}.lmcache_2961:make",
        clean=f"{MODELS}.lmcache_2961:make_fixed",
        detector=Detector(scenarios=("keys-lora",)),
        requires="refserve",
    ),
    Entry(
        bug="NVIDIA/TensorRT-LLM#13793",
        url="https://github.com/NVIDIA/TensorRT-LLM/pull/13793",
        fix="https://github.com/NVIDIA/TensorRT-LLM/pull/13793",
        engine="tensorrt-llm",
        affected="KVCacheManagerV2 before the salted seed (2026-05)",
        fixed="PR 13793 (merged 2026-05): the seed mixes in the cache salt",
        symptom=(
            "The V2 KV cache manager rooted its reuse tree at the LoRA task alone, so a "
            "request's cache salt never reached a block key: two tenants with different "
            "salts and the same prompt shared blocks, the isolation the salt promises (and "
            "the V1 manager gave) silently gone. A model: refserve's engine with the V2 seed."
        ),
        rule=Rule.KEY_DOMAINS,
        reproduction=Reproduction.MODEL,
        environment="",
        buggy=f"{MODELS}.trtllm_13793:make",
        clean=f"{MODELS}.trtllm_13793:make_fixed",
        detector=Detector(scenarios=("keys-cache-salt",)),
        requires="refserve",
    ),
    Entry(
        bug="NVIDIA/TensorRT-LLM#12673",
        url="https://github.com/NVIDIA/TensorRT-LLM/pull/12673",
        fix="https://github.com/NVIDIA/TensorRT-LLM/pull/12673",
        engine="tensorrt-llm",
        affected="main before 2026-04; release/1.2.1 and 1.3.0rc5.post2 before their cherry-picks",
        fixed="PR 12673 (merged 2026-04): only materialized tokens are stored",
        symptom=(
            "A request leaving in the middle of a chunked prefill had its blocks stored for "
            "reuse up to its last known token, as if the whole prompt were computed: the "
            "blocks of the chunks never run went into the reuse tree under the prompt's "
            "tokens, and the next request with that prompt attended to K/V nobody wrote. A "
            "model of the block manager's release path."
        ),
        rule=Rule.PREFIX,
        reproduction=Reproduction.MODEL,
        environment="",
        buggy=f"{MODELS}.trtllm_12673:make_kv",
        clean=f"{MODELS}.trtllm_12673:make_kv_fixed",
        detector=Detector(kv_scenarios=("kv-free-mid-prefill",)),
        requires="refserve",
    ),
    Entry(
        bug="InternLM/lmdeploy#3589",
        url="https://github.com/InternLM/lmdeploy/pull/3589",
        fix="https://github.com/InternLM/lmdeploy/commit/51e5dbf92",
        engine="lmdeploy",
        affected="up to 0.8.0 (the recompute eviction helper, since 0.4.2)",
        fixed="0.9.0",
        symptom=(
            "When the eviction helper took a preempted sequence's blocks to make room for "
            "another, it freed them but left the sequence's step where it was: a KV length "
            "with an empty block table. Admitted again, the sequence got fresh blocks for "
            "every token while the model computed only those after the stale length, so "
            "attention read the first positions from blocks holding another request's K/V."
        ),
        rule=Rule.BLOCK,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-lmdeploy",
        buggy=f"{PATCHES}.lmdeploy_3589:make",
        clean=LMDEPLOY,
        detector=Detector(scenarios=("pressure-victim-recomputes-without-cache",)),
        requires="lmdeploy",
    ),
    Entry(
        bug="InternLM/lmdeploy#4100",
        url="https://github.com/InternLM/lmdeploy/pull/4100",
        fix="https://github.com/InternLM/lmdeploy/pull/4110",
        engine="lmdeploy",
        affected="main from lmdeploy#4076 (2025-10-30) to 2025-11-07; no release",
        fixed="0.11.0 (the free-ratio gate removed)",
        symptom=(
            "Prefill was refused while fewer than a tenth of the pool's blocks were free, "
            "and the count left out the blocks only the prefix cache held, which admission "
            "evicts on demand. Once finished requests left most of the pool cached, a new "
            "request was never admitted and nothing ran, until the engine's decode of an "
            "empty batch failed an assertion."
        ),
        rule=Rule.PROGRESS,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-lmdeploy",
        buggy=f"{PATCHES}.lmdeploy_4100:make",
        clean=LMDEPLOY,
        detector=Detector(scenarios=("bug-free-list-order",)),
        requires="lmdeploy",
    ),
    Entry(
        bug="sgl-project/sglang#24638",
        url="https://github.com/sgl-project/sglang/issues/24638",
        fix="https://github.com/sgl-project/sglang/pull/25351",
        engine="sglang",
        affected="0.5.23; main at 95fb722 (2026-05), the tracker's",
        fixed="not fixed: PR 25351 closed unmerged; the clean side applies its structure",
        symptom=(
            "A request's radix-tree namespace is the caller's extra key and the LoRA "
            "adapter's id joined end to end, so a base-model request whose key is an "
            "adapter's id, or two requests whose key and adapter split one string "
            "differently, share cached pages: K/V computed under one adapter's weights "
            "serves a request that runs without it."
        ),
        rule=Rule.KEY_DOMAINS,
        reproduction=Reproduction.RELEASED,
        environment="conformance-sglang",
        buggy=SGLANG_KV,
        clean=f"{PATCHES}.sglang_24638_fixed:make_kv",
        detector=Detector(kv_scenarios=("kv-keys-adapter-named-like-salt", "kv-keys-split-fields")),
        requires="sglang",
    ),
    Entry(
        bug="vllm-project/vllm#57104",
        url="https://github.com/vllm-project/vllm/pull/57104",
        fix="https://github.com/vllm-project/vllm/pull/57104",
        engine="vllm",
        affected="async-load reservations (PR 44560) before 2026-09-16, with speculative decoding",
        fixed="0.33.0 (a load's admission also reserves the blocks of the speculative step)",
        symptom=(
            "With speculative decoding and a KV connector under KV pressure, two requests "
            "admitted as asynchronous loads take every free block; the first to land needs "
            "one more block for its first step with drafts, none is free, the scan stops at "
            "it, and the second load is never promoted: nothing runs, forever."
        ),
        rule=Rule.PROGRESS,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-vllm",
        buggy=f"{PATCHES}.vllm_57104:make",
        clean=VLLM_OFFLOAD,
        detector=Detector(scenarios=("pressure-loads-land-with-drafts",)),
        requires="vllm",
    ),
    Entry(
        bug="vllm-project/vllm#53495",
        url="https://github.com/vllm-project/vllm/issues/53495",
        fix="https://github.com/vllm-project/vllm/pull/53496",
        engine="vllm",
        affected="0.33.0 with ExampleConnector (main 2026-08)",
        fixed="PR 53496 (open, not merged): the clean side applies it",
        symptom=(
            "The example KV connector names a stored prefix by its prompt tokens alone; the "
            "cache salt and the LoRA adapter are left out. A request under another salt or "
            "adapter, with the same prompt, finds the folder another tenant's request "
            "wrote and is handed that K/V as its external hit."
        ),
        rule=Rule.KEY_DOMAINS,
        reproduction=Reproduction.RELEASED,
        environment="conformance-vllm",
        buggy=VLLM_EXAMPLE,
        clean=f"{PATCHES}.vllm_53495_fixed:make",
        detector=Detector(scenarios=("keys-cache-salt", "keys-lora")),
        requires="vllm",
    ),
    Entry(
        bug="vllm-project/vllm#16928",
        url="https://github.com/vllm-project/vllm/issues/16928",
        fix="https://github.com/vllm-project/vllm/pull/53314",
        engine="vllm",
        affected="0.33.0 with ExampleConnector and chunked prefill (since 2025-04)",
        fixed="PR 53314 (open, not merged): the clean side applies it",
        symptom=(
            "Under chunked prefill the example KV connector saves a prompt's K/V in the "
            "request's first step only, so the save holds the first chunk; a later request "
            "with that prompt is told the whole prefix is stored, and the worker fails when "
            "the saved tensor does not fit the slots it was to fill."
        ),
        rule=Rule.PROGRESS,
        reproduction=Reproduction.RELEASED,
        environment="conformance-vllm",
        buggy=VLLM_EXAMPLE,
        clean=f"{PATCHES}.vllm_16928_fixed:make",
        detector=Detector(scenarios=("pressure-chunked-prompt-again",)),
        requires="vllm",
    ),
    Entry(
        bug="vllm-project/vllm#54193",
        url="https://github.com/vllm-project/vllm/issues/54193",
        fix="https://github.com/vllm-project/vllm/pull/54288",
        engine="vllm",
        affected="main before PR 54288 (2026-09), offloading outputs (offload_prompt_only=False)",
        fixed="0.33.0 (a finished request is stored up to its last computed token)",
        symptom=(
            "The offloading connector stored a finished request's blocks up to its last "
            "sampled token, whose K/V no forward pass writes. An answer ending on a block "
            "boundary left a full-looking block with one unwritten slot on the CPU, and "
            "the next turn of the conversation loaded it: its K/V at that position was "
            "whatever the slot held."
        ),
        rule=Rule.POS,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-vllm",
        buggy=f"{PATCHES}.vllm_54193:make",
        clean=VLLM_OFFLOAD_OUTPUTS,
        detector=Detector(scenarios=("pressure-next-turn",)),
        requires="vllm",
    ),
    Entry(
        bug="vllm-project/vllm#49285",
        url="https://github.com/vllm-project/vllm/pull/49285",
        fix="https://github.com/vllm-project/vllm/pull/49285",
        engine="vllm",
        affected="main before PR 49285 (2026-07) with the offloading connector",
        fixed="0.33.0 (an aborted request is stored up to the tokens it computed)",
        symptom=(
            "The offloading connector stored an aborted request's blocks up to its whole "
            "prompt. Aborted after a first chunk that ended inside a block, it left that "
            "block on the CPU under the prompt's hash with positions never computed, and a "
            "later request with the same prompt loaded them."
        ),
        rule=Rule.POS,
        reproduction=Reproduction.REAPPLIED,
        environment="conformance-vllm",
        buggy=f"{PATCHES}.vllm_49285:make",
        clean=VLLM_OFFLOAD,
        detector=Detector(scenarios=("pressure-aborted-prompt-again",)),
        requires="vllm",
    ),
)
