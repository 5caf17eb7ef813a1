"""The fixed KV scenarios, run before the generated search (docs/CONFORMANCE.md)."""

from __future__ import annotations

from typing import Any

from refserve.conformance.kv.protocol import KVConfig, KVFeature
from refserve.conformance.kv.workload import KVScenario, KVWorkload

GENERATED_NAME = "kv-generated"


def _new(rid: str, prompt: list[int], n: int) -> dict[str, Any]:
    return {"op": "new", "rid": rid, "prompt": prompt, "n": n}


def _grow(rid: str, append: list[int], n: int = 1) -> dict[str, Any]:
    return {"op": "grow", "rid": rid, "append": append, "n": n}


def _new_in(rid: str, prompt: list[int], n: int, lora: str = "", salt: str = "") -> dict[str, Any]:
    """A ``new`` op in a key namespace (feature ``key_domains``)."""
    op = _new(rid, prompt, n)
    if lora:
        op["lora"] = lora
    if salt:
        op["cache_salt"] = salt
    return op


def _fork(parent: str, child: str) -> dict[str, Any]:
    return {"op": "fork", "parent": parent, "child": child}


def _free(rid: str) -> dict[str, Any]:
    return {"op": "free", "rid": rid}


def kv_scenarios() -> list[KVScenario]:
    """The fixed KV scenarios, run before the generated search."""
    return [
        KVScenario(
            "kv-fork-cow",
            "Block size 2: a 3-token prompt forked, then both sides decode into the shared "
            "partial block (copy-on-write), then a fork of a fork and an append after the "
            "other holder left (no copy needed any more).",
            KVWorkload(
                KVConfig(8, 2),
                (
                    _new("r1", [1, 2, 3], 3),
                    _fork("r1", "r2"),
                    _grow("r2", [4]),
                    _grow("r1", [5]),
                    _grow("r2", [6]),
                    _grow("r1", [7]),
                    _fork("r2", "r3"),
                    _free("r2"),
                    _grow("r3", [8]),
                    _fork("r1", "r4"),
                    _grow("r1", [9]),
                    _grow("r4", [0]),
                ),
            ),
            frozenset({KVFeature.FORK}),
            ("BLOCK", "PREFIX"),
        ),
        KVScenario(
            "kv-prefix-reuse",
            "Two requests share a 2-block prefix and are freed; an unrelated request takes "
            "every block (evicting the cached prefix); a third request with the old prefix "
            "must not hit the reused blocks (a stale cache entry reads back wrong tokens).",
            KVWorkload(
                KVConfig(4, 2),
                (
                    _new("r1", [1, 2, 3, 4, 5], 5),
                    _new("r2", [1, 2, 3, 4, 6], 1),
                    _free("r1"),
                    _free("r2"),
                    _new("r3", [7, 8, 7, 8, 7, 8, 7, 8], 8),
                    _free("r3"),
                    _new("r4", [1, 2, 3, 4, 5], 1),
                    _new("r5", [7, 8, 7, 8, 7], 1),
                ),
            ),
            frozenset({KVFeature.PREFIX_CACHING}),
            ("PREFIX", "BLOCK"),
        ),
        KVScenario(
            "kv-double-free",
            "Blocks shared by a parent and two forks are released once per holder: freeing "
            "one holder must not free a block the others still read (or free it twice).",
            KVWorkload(
                KVConfig(6, 2),
                (
                    _new("r1", [1, 2, 3, 4, 5], 5),
                    _fork("r1", "r2"),
                    _fork("r1", "r3"),
                    _free("r2"),
                    _grow("r1", [6]),
                    _free("r1"),
                    _new("r4", [9, 9, 9, 9, 9, 9], 6),
                    _free("r3"),
                    _free("r4"),
                    _new("r5", [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5], 12),
                ),
            ),
            frozenset({KVFeature.FORK}),
            ("BLOCK", "PROGRESS"),
        ),
        KVScenario(
            "kv-no-space",
            "A full 3-block pool refuses a new request and a growing one (nothing may "
            "change), serves the new one once blocks are free (a refusal with room is "
            "CAP), refuses it 3 blocks with 2 free (grabbing those 2 before giving up is "
            "ATOMIC), then serves it 1.",
            KVWorkload(
                KVConfig(3, 2),
                (
                    _new("r1", [1, 2, 3, 4, 5], 5),
                    _new("r2", [6, 7], 2),
                    _grow("r1", [8]),
                    _grow("r1", [9]),
                    _free("r1"),
                    _new("r2", [6, 7], 2),
                    _grow("r2", [1, 2, 3, 4, 5], 5),
                    _grow("r2", [], 2),
                ),
            ),
            frozenset(),
            ("ATOMIC", "CAP"),
        ),
        *_corpus_kv_scenarios(),
    ]


def _corpus_kv_scenarios() -> list[KVScenario]:
    """KV scenarios added with the corpus of real bugs (docs/CORPUS.md)."""
    return [
        KVScenario(
            "kv-keys-adapter-named-like-salt",
            "Block size 2: a 6-token prompt on LoRA adapter x, then the same prompt with "
            "cache salt x while the first runs, then (both freed) on the base model and "
            "on adapter x again. Only the two adapter-x requests may share K/V: an "
            "adapter's identity and a salt that are the same string are different inputs.",
            KVWorkload(
                KVConfig(8, 2),
                (
                    _new_in("r1", [1, 2, 3, 4, 5, 6], 6, lora="x"),
                    _new_in("r2", [1, 2, 3, 4, 5, 6], 1, salt="x"),
                    _free("r1"),
                    _free("r2"),
                    _new("r3", [1, 2, 3, 4, 5, 6], 1),
                    _free("r3"),
                    _new_in("r4", [1, 2, 3, 4, 5, 6], 1, lora="x"),
                ),
            ),
            frozenset({KVFeature.KEY_DOMAINS, KVFeature.PREFIX_CACHING}),
            ("PREFIX",),
        ),
        KVScenario(
            "kv-keys-split-fields",
            "Block size 2: a 6-token prompt with salt a on adapter bc, freed, then with "
            "salt ab on adapter c: two different namespaces whose fields joined end to end "
            "are the same string; the second may not reuse the first's K/V.",
            KVWorkload(
                KVConfig(8, 2),
                (
                    _new_in("r1", [1, 2, 3, 4, 5, 6], 6, lora="bc", salt="a"),
                    _free("r1"),
                    _new_in("r2", [1, 2, 3, 4, 5, 6], 1, lora="c", salt="ab"),
                ),
            ),
            frozenset({KVFeature.KEY_DOMAINS, KVFeature.PREFIX_CACHING}),
            ("PREFIX",),
        ),
        KVScenario(
            "kv-free-mid-prefill",
            "Block size 2: a 6-token prompt freed after a first chunk of 3 tokens, its "
            "second block half written; the same prompt again may hit only the block the "
            "chunk filled (a cache entry for the half-written block serves K/V nobody "
            "computed).",
            KVWorkload(
                KVConfig(6, 2),
                (
                    _new("r1", [1, 2, 3, 4, 5, 6], 3),
                    _free("r1"),
                    _new("r2", [1, 2, 3, 4, 5, 6], 1),
                ),
            ),
            frozenset(),  # without prefix caching there is no hit, and nothing to catch
            ("PREFIX",),
        ),
    ]


#: The KV scenarios added with the corpus of real bugs, which the suite of before did
#: not have.
KV_CORPUS_SCENARIOS = frozenset(s.name for s in _corpus_kv_scenarios())


def kv_scenario_names() -> list[str]:
    return [s.name for s in kv_scenarios()] + [GENERATED_NAME]
