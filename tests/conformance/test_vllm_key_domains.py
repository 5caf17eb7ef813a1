"""Key domains on vLLM 0.33.0: cache salts and LoRA adapters keep requests apart, and the
re-applied vllm#44701 (conformance/corpus/patches/vllm_44701.py) is caught.

vLLM lives in its own virtualenv; run with
``.venv-vllm/bin/python -m pytest tests/conformance/test_vllm_key_domains.py``
or any interpreter where ``vllm`` and this checkout's refserve import.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM lives in .venv-vllm: make conformance-vllm")

from refserve.conformance.adapter import AdapterFactory, load_factory
from refserve.conformance.corpus.patches import vllm_44701
from refserve.conformance.runner import RunResult, run_with
from refserve.conformance.scenarios import by_name

KEY_SCENARIOS = (
    "keys-cache-salt",
    "keys-lora",
    "keys-salt-named-like-adapter",
    "keys-refill-behind-other-prefix",
)
CAUGHT = "keys-salt-named-like-adapter"


def _run(factory: AdapterFactory, name: str) -> RunResult:
    result = run_with(factory, by_name()[name].workload)
    assert not result.not_supported, f"{name}: {result.not_supported}"
    return result


def _describe(result: RunResult) -> list[str]:
    return [f"step {f.step}: {f.violation}" for f in result.findings]


@pytest.mark.parametrize("name", KEY_SCENARIOS)
def test_the_fixed_adapter_passes_every_key_scenario(name: str) -> None:
    result = _run(load_factory(vllm_44701.FIXED), name)
    assert result.findings == [], _describe(result)


@pytest.mark.parametrize("name", ["keys-cache-salt", "keys-lora"])
def test_requests_of_one_domain_still_share(name: str) -> None:
    # B and D run in one domain (salt t1, adapter l1): D's first two blocks come from B.
    # Without the hit the clean pass above would say nothing about the keys.
    result = _run(load_factory(vllm_44701.FIXED), name)
    assert result.observed.cached_tokens == 8


def test_the_buggy_adapter_serves_the_salted_request_the_adapters_block() -> None:
    result = _run(load_factory(vllm_44701.BUGGY), CAUGHT)
    assert result.findings, "vllm#44701 re-applied, yet nothing was found"
    assert all(f.violation.rule == "key-domains" for f in result.findings), _describe(result)
    assert all(str(f.invariant) == "PREFIX" for f in result.findings), _describe(result)
    first = result.findings[0]
    assert first.violation.subject == "request B"
    assert "position 0" in first.violation.message
    assert "another key domain" in first.violation.message


@pytest.mark.parametrize("name", [n for n in KEY_SCENARIOS if n != CAUGHT])
def test_the_buggy_adapter_passes_the_other_key_scenarios(name: str) -> None:
    # Only a name equal to a salt collides: distinct salts, distinct adapters and prefixes
    # still hash apart with the untagged keys.
    result = _run(load_factory(vllm_44701.BUGGY), name)
    assert result.findings == [], _describe(result)


def _block_hashes(hasher: Any, *, lora: str = "", salt: str = "") -> list[Any]:
    v = vllm_44701.fixed.V
    adapter = vllm_44701.fixed.VllmAdapter()
    request = v.Request(
        request_id="r",
        prompt_token_ids=[5, 6, 7, 8, 9, 10, 11, 12],
        sampling_params=v.SamplingParams.from_optional(max_tokens=1),
        pooling_params=None,
        lora_request=adapter._lora_request(lora),
        cache_salt=salt or None,
        block_hasher=hasher,
    )
    return list(request.block_hashes)


def test_the_patch_changes_only_its_own_hasher() -> None:
    v = vllm_44701.fixed.V
    hash_fn = v.get_hash_fn_by_name("sha256")
    v.init_none_hash(hash_fn)
    buggy = vllm_44701.get_request_block_hasher_44701(4, hash_fn, 0)
    fixed = v.get_request_block_hasher(4, hash_fn, 0)
    on_x, salted = _block_hashes(buggy, lora="x"), _block_hashes(buggy, salt="x")
    assert on_x[0] == salted[0]  # the collision of the tracker, block 0 only
    assert on_x[1] != salted[1]
    on_x, salted = _block_hashes(fixed, lora="x"), _block_hashes(fixed, salt="x")
    assert on_x[0] != salted[0]
    # vLLM's module keeps the fixed function: the patch lives in its own globals.
    utils = vllm_44701._utils
    assert utils.generate_block_hash_extra_keys is not (
        vllm_44701.generate_block_hash_extra_keys_44701
    )
    assert utils.generate_block_hash_extra_keys(_request_on("x"), 0, 4, 0)[0] == (
        ("lora", "x", f"{vllm_44701.fixed.LORA_PATH_ROOT}/x"),
    )


def _request_on(lora: str) -> Any:
    v = vllm_44701.fixed.V
    return v.Request(
        request_id="r",
        prompt_token_ids=[5, 6, 7, 8],
        sampling_params=v.SamplingParams.from_optional(max_tokens=1),
        pooling_params=None,
        lora_request=vllm_44701.fixed.VllmAdapter()._lora_request(lora),
    )


def test_the_fixed_adapter_passes_after_the_buggy_one_in_one_process() -> None:
    assert _run(load_factory(vllm_44701.BUGGY), CAUGHT).findings
    result = _run(load_factory(vllm_44701.FIXED), CAUGHT)
    assert result.findings == [], _describe(result)


def test_each_adapter_name_keeps_one_lora_id() -> None:
    adapter = vllm_44701.fixed.VllmAdapter()
    l1, l2, again = (adapter._lora_request(n) for n in ("l1", "l2", "l1"))
    assert (l1.lora_int_id, l2.lora_int_id, again.lora_int_id) == (1, 2, 1)
    assert adapter._lora_request("") is None
