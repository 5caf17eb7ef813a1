"""CrossHair proves the contracts of spec/arith.py and of the core's pure decision
functions (CROSSHAIR_MODULES in the Makefile), and refutes a planted bug in each.

Plus plain unit and property tests of the same arithmetic and of the hash chain.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refserve.core.capacity import exceeds_pool, whole_request_blocks
from refserve.core.policy import aged_priority
from refserve.core.prefill import prefill_chunk
from refserve.core.speculation import draft_count
from refserve.core.swap import PreemptionMode, preempt_by_swap
from refserve.spec.arith import (
    blocks_needed,
    cdiv,
    chunk_size,
    max_cacheable_tokens,
    new_blocks_needed,
    slot_of,
)
from refserve.spec.hashing import DEFAULT_NAMESPACE, Namespace, block_key, chain_keys

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "spec" / "arith.py"
CROSSHAIR = Path(sys.executable).parent / "crosshair"
# The core modules whose pure functions carry contracts. They are checked in one process
# (each import of refserve.core pays ~3 s for torch); spec/arith.py imports nothing and is
# checked alone.
CORE_MODULES = ["capacity", "prefill", "speculation", "swap", "policy"]
CORE_CONTRACTS = [ROOT / "ref" / "core" / f"{m}.py" for m in CORE_MODULES]


def crosshair_check(
    *targets: Path | str, cwd: Path, report_all: bool = False
) -> subprocess.CompletedProcess[str]:
    """One crosshair process over ``targets`` (files, or ``file:line`` for one function).

    PYTHONPATH names this checkout: a planted copy outside it imports ``ref`` and ``spec``,
    and the shared virtualenv's editable install may point at another checkout.
    """
    flags = ["--report_all"] if report_all else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [str(CROSSHAIR), "check", *flags, "--per_condition_timeout=5", *map(str, targets)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def confirmed_lines(stdout: str, path: Path) -> set[int]:
    """Lines of ``path`` whose condition CrossHair reports confirmed over all paths."""
    found = re.findall(
        rf"^{re.escape(str(path))}:(\d+): info: Confirmed over all paths", stdout, re.M
    )
    return {int(n) for n in found}


def post_lines(path: Path) -> set[int]:
    return {i for i, line in enumerate(path.read_text().splitlines(), 1) if "post: " in line}


def test_crosshair_proves_arith_contracts() -> None:
    assert CROSSHAIR.exists(), f"crosshair not installed next to {sys.executable}"
    result = crosshair_check(ARITH, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_crosshair_confirms_every_postcondition() -> None:
    """Guard against an assurance that checked nothing: each post: is confirmed."""
    result = crosshair_check(ARITH, cwd=ROOT, report_all=True)
    assert result.returncode == 0, result.stdout + result.stderr
    num_posts = ARITH.read_text().count("post: ")
    confirmed = [line for line in result.stdout.splitlines() if "Confirmed over all paths" in line]
    assert len(confirmed) == num_posts, result.stdout


def test_crosshair_confirms_every_core_postcondition() -> None:
    """The core's contracts hold, each confirmed over all paths (a "Not confirmed" within
    the time bound would pass ``make crosshair`` while checking nothing)."""
    result = crosshair_check(*CORE_CONTRACTS, cwd=ROOT, report_all=True)
    assert result.returncode == 0, result.stdout + result.stderr
    for path in CORE_CONTRACTS:
        assert post_lines(path), f"{path.name} carries no contract"
        assert confirmed_lines(result.stdout, path) == post_lines(path), result.stdout


def test_crosshair_modules_are_the_makefile_list() -> None:
    """``make crosshair`` proves what these tests show failing on a planted bug."""
    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"^CROSSHAIR_MODULES := ((?:.*\\\n)*.*)$", makefile, re.M)
    assert listed is not None
    modules = set(listed.group(1).replace("\\\n", " ").split())
    core = {f"refserve.core.{m}" for m in CORE_MODULES}
    spec = {"refserve.spec.arith", "refserve.spec.hashing", "refserve.spec.groups"}
    assert modules == {*spec, *core, "refserve.conformance.explore.key"}


KEY = ROOT / "conformance" / "explore" / "key.py"
GROUPS = ROOT / "spec" / "groups.py"


def test_crosshair_proves_window_start() -> None:
    """spec/groups.py's window_start: the first key a window query reads, within the
    window, and exactly W - 1 back once the sequence is longer than that."""
    result = crosshair_check(GROUPS, cwd=ROOT, report_all=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert post_lines(GROUPS), "window_start carries no contract"
    assert confirmed_lines(result.stdout, GROUPS) == post_lines(GROUPS), result.stdout


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("    return max(0, num_tokens - window)\n", id="reads-one-key-too-many"),
        pytest.param("    return max(0, num_tokens - window + 2)\n", id="drops-a-key-it-reads"),
    ],
)
def test_crosshair_finds_a_planted_window_start_bug(tmp_path: Path, bad: str) -> None:
    source = GROUPS.read_text()
    good = "    return max(0, num_tokens - window + 1)\n"
    assert source.count(good) == 1, "plant site of window_start moved"
    planted = tmp_path / "groups_planted.py"
    planted.write_text(source.replace(good, bad))
    result = crosshair_check(planted, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "when calling window_start(" in result.stdout, result.stdout


def test_crosshair_proves_the_canonical_renaming() -> None:
    """The explorer's symmetry reduction (docs/CONFORMANCE.md, "Exhaustive exploration"):
    block ids renamed by first use keep exactly their equality pattern."""
    result = crosshair_check(KEY, cwd=ROOT, report_all=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert post_lines(KEY) and confirmed_lines(result.stdout, KEY) == post_lines(KEY), result.stdout


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("        out.append(b)\n", id="raw-ids-kept"),
        pytest.param("        out.append(len(seen) - 1)\n", id="a-repeat-gets-the-newest-name"),
    ],
)
def test_crosshair_finds_a_planted_renaming_bug(tmp_path: Path, bad: str) -> None:
    source = KEY.read_text()
    good = "        out.append(seen.index(b))\n"
    assert source.count(good) == 1, "plant site of first_use moved"
    planted = tmp_path / "key_planted.py"
    planted.write_text(source.replace(good, bad))
    result = crosshair_check(planted, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "when calling first_use(" in result.stdout, result.stdout


PLANTS = [
    pytest.param(
        "blocks_needed",
        "    return -(-num_tokens // block_size)\n",
        "    return num_tokens // block_size\n",
        id="blocks_needed-floor",
    ),
    pytest.param(
        "max_cacheable_tokens",
        "    return ((num_prompt_tokens - 1) // block_size) * block_size\n",
        "    return (num_prompt_tokens // block_size) * block_size\n",
        id="max_cacheable_tokens-serves-last-token",
    ),
    pytest.param(
        "slot_of",
        "    return block_id * block_size + position % block_size\n",
        "    return block_id * block_size + (position + 1) % block_size\n",
        id="slot_of-off-by-one",
    ),
    pytest.param(
        "block_offset",
        "    return position % block_size\n",
        "    return (position + 1) % block_size\n",
        id="block_offset-off-by-one",
    ),
    pytest.param(
        "logical_block",
        "    return position // block_size\n",
        "    return (position + 1) // block_size\n",
        id="logical_block-off-by-one",
    ),
    pytest.param(
        "full_blocks",
        "    return num_tokens // block_size\n",
        "    return cdiv(num_tokens, block_size)\n",
        id="full_blocks-counts-a-partial-block",
    ),
    pytest.param(
        "fills_block",
        "    return offset == block_size - 1\n",
        "    return offset == block_size\n",
        id="fills_block-past-the-end",
    ),
    pytest.param(
        "starts_block",
        "    return offset == 0\n",
        "    return offset == 1\n",
        id="starts_block-off-by-one",
    ),
    pytest.param(
        "length_limit",
        "    return min(num_prompt_tokens + max_tokens, max_len)\n",
        "    return min(num_prompt_tokens + max_tokens, max_len + 1)\n",
        id="length_limit-one-past-max-len",
    ),
    pytest.param(
        "reaches_length",
        "    return num_tokens >= limit\n",
        "    return num_tokens > limit\n",
        id="reaches_length-a-token-late",
    ),
    pytest.param(
        "chunk_size",
        "        n = max(0, end - num_computed)\n",
        "        n = max(0, end - num_computed - block_size)\n",
        id="chunk_size-aligns-a-block-too-far-back",
    ),
]


@pytest.mark.parametrize(("function", "good", "bad"), PLANTS)
def test_crosshair_finds_planted_off_by_one(
    tmp_path: Path, function: str, good: str, bad: str
) -> None:
    source = ARITH.read_text()
    assert source.count(good) == 1, f"plant site for {function} moved"
    planted = tmp_path / "arith_planted.py"
    planted.write_text(source.replace(good, bad))
    result = crosshair_check(planted, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"when calling {function}(" in result.stdout, result.stdout


@dataclass(frozen=True)
class CorePlant:
    """One bug planted in a copy of a core module: ``good`` becomes ``bad``."""

    name: str
    module: str
    function: str
    good: str
    bad: str


CORE_PLANTS = [
    CorePlant(
        "exceeds_pool-refuses-an-exact-fit",
        "capacity",
        "exceeds_pool",
        "    return blocks_needed(num_tokens, block_size) > num_blocks\n",
        "    return blocks_needed(num_tokens, block_size) >= num_blocks\n",
    ),
    CorePlant(
        "whole_request_blocks-forgets-revived-blocks",
        "capacity",
        "whole_request_blocks",
        "    return max(first, blocks_needed(num_total, block_size) - num_held + revived)\n",
        "    return max(first, blocks_needed(num_total, block_size) - num_held)\n",
    ),
    CorePlant(
        "prefill_chunk-refuses-a-prompt-that-fills-the-budget",
        "prefill",
        "prefill_chunk",
        "        return num_remaining if num_remaining <= budget_left else 0\n",
        "        return num_remaining if num_remaining < budget_left else 0\n",
    ),
    CorePlant(
        "draft_count-forgets-the-bonus-token",
        "speculation",
        "draft_count",
        "    return max(min(num_proposed, room - 1, budget_left - 1), 0)\n",
        "    return max(min(num_proposed, room, budget_left - 1), 0)\n",
    ),
    CorePlant(
        "preempt_by_swap-auto-ignores-the-cost",
        "swap",
        "preempt_by_swap",
        "    if mode is PreemptionMode.AUTO:\n        return swap_is_cheaper\n",
        "    if mode is PreemptionMode.SWAP:\n        return swap_is_cheaper\n",
    ),
    CorePlant(
        "preempt_by_swap-swaps-an-empty-victim",
        "swap",
        "preempt_by_swap",
        "    if mode is PreemptionMode.RECOMPUTE or not num_stored:\n",
        "    if mode is PreemptionMode.RECOMPUTE:\n",
    ),
    CorePlant(
        "aged_priority-ages-a-step-early",
        "policy",
        "aged_priority",
        "    return priority - (step_index - queued_step) // aging_steps\n",
        "    return priority - (step_index - queued_step + 1) // aging_steps\n",
    ),
]


@pytest.fixture(scope="module")
def core_plant_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Path]]:
    """Every core plant, each in its own copy of its module, in ONE crosshair process
    (torch is imported once, not once per plant); each copy is checked only at its
    planted function (``file:line``), so the copy's other contracts are not re-proved."""
    where = tmp_path_factory.mktemp("core_plants")
    targets: list[str] = []
    files: dict[str, Path] = {}
    for plant in CORE_PLANTS:
        source = (ROOT / "ref" / "core" / f"{plant.module}.py").read_text()
        assert source.count(plant.good) == 1, f"plant site of {plant.name} moved"
        planted = where / f"{plant.name.replace('-', '_')}.py"
        planted.write_text(source.replace(plant.good, plant.bad))
        lines = planted.read_text().splitlines()
        line = next(i for i, x in enumerate(lines, 1) if x.startswith(f"def {plant.function}("))
        targets.append(f"{planted}:{line}")
        files[plant.name] = planted
    return crosshair_check(*targets, cwd=where), files


@pytest.mark.parametrize("plant", CORE_PLANTS, ids=lambda p: p.name)
def test_crosshair_finds_planted_core_bug(
    core_plant_run: tuple[subprocess.CompletedProcess[str], dict[str, Path]], plant: CorePlant
) -> None:
    result, files = core_plant_run
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [
        line
        for line in result.stdout.splitlines()
        if line.startswith(f"{files[plant.name]}:") and ": error: " in line
    ]
    assert any(f"when calling {plant.function}(" in line for line in errors), result.stdout


# ------------------------------------------------------------ unit: core decisions
def test_core_decisions_on_examples() -> None:
    """The extracted functions on hand-checked cases, without CrossHair."""
    assert not exceeds_pool(64, 16, 4) and exceeds_pool(65, 16, 4)  # 4 blocks hold 64 slots
    assert whole_request_blocks(1, 0, 16, 1600, 16) == 100  # example 2e: 100 blocks
    # A hit of 2 blocks, 1 of them revived: the first chunk asks 2 fresh + 1 revived.
    assert whole_request_blocks(3, 2, 5, 40, 4) == 9  # 10 blocks - 2 held + 1 revived
    assert whole_request_blocks(3, 2, 5, 13, 4) == 3  # the prompt is the first chunk
    assert prefill_chunk(12, 7, 4, 0, chunked=True, align_to_block=False) == 7  # example 1
    assert prefill_chunk(8, 8, 4, 0, chunked=False, align_to_block=False) == 8
    assert prefill_chunk(9, 8, 4, 0, chunked=False, align_to_block=False) == 0
    assert draft_count(5, 3, 100) == 2 and draft_count(5, 100, 4) == 3
    assert draft_count(5, 1, 100) == 0 and draft_count(0, 100, 100) == 0
    auto = PreemptionMode.AUTO
    facts = {"never_fits": False, "host_has_room": True}
    assert preempt_by_swap(auto, 10, **facts, swap_is_cheaper=True)
    assert not preempt_by_swap(auto, 10, **facts, swap_is_cheaper=False)
    assert preempt_by_swap(PreemptionMode.SWAP, 10, **facts, swap_is_cheaper=False)
    assert not preempt_by_swap(PreemptionMode.RECOMPUTE, 10, **facts, swap_is_cheaper=True)
    assert not preempt_by_swap(auto, 10, never_fits=True, host_has_room=True, swap_is_cheaper=True)
    assert [aged_priority(3, 5, s, 4) for s in (5, 8, 9, 13)] == [3, 3, 2, 1]
    assert aged_priority(3, 5, 100, 0) == 3


# ------------------------------------------------------------------ unit: arith
def test_arith_examples_from_the_seeds() -> None:
    assert blocks_needed(17, 16) == 2 and blocks_needed(31, 16) == 2  # example 0b
    assert [blocks_needed(n, 4) for n in (7, 12, 13, 14)] == [2, 3, 4, 4]  # example 1
    assert slot_of(12, 8, 4) == 48  # example 1: B's table 7, 2, 12; position 8
    assert slot_of(7, 3, 4) == 31
    assert blocks_needed(1600, 16) == 100  # example 2e admission
    assert max_cacheable_tokens(10_000, 16) == 9_984
    assert chunk_size(12, 7, 4, False, 0) == 7  # example 1: B gets 7, then 5
    assert chunk_size(5, 5, 4, False, 7) == 5
    assert chunk_size(4000, 1021, 16, True, 6000) == 1008  # example 3: 63 blocks


def test_arith_edges() -> None:
    assert cdiv(0, 5) == 0 and cdiv(1, 5) == 1 and cdiv(5, 5) == 1 and cdiv(6, 5) == 2
    assert blocks_needed(0, 4) == 0
    assert new_blocks_needed(3, 1, 1, 4) == 0
    assert new_blocks_needed(4, 1, 1, 4) == 1
    assert new_blocks_needed(0, 9, 0, 4) == 3
    assert new_blocks_needed(2, 0, 1, 4) == 0
    assert max_cacheable_tokens(1, 4) == 0
    assert max_cacheable_tokens(4, 4) == 0  # block-aligned: the last block is recomputed
    assert max_cacheable_tokens(5, 4) == 4
    assert max_cacheable_tokens(8, 1) == 7
    assert chunk_size(3, 10, 4, True, 0) == 3  # finishing the prompt need not align
    assert chunk_size(10, 3, 4, True, 0) == 0  # cannot reach a boundary: take nothing
    assert chunk_size(10, 3, 4, True, 1) == 3  # 1 + 3 lands on the boundary
    assert chunk_size(10, 0, 4, False, 0) == 0


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_blocks_needed_is_the_least_cover(n: int, bs: int) -> None:
    k = blocks_needed(n, bs)
    assert k * bs >= n and (k == 0 or (k - 1) * bs < n)


@given(st.integers(0, 1000), st.integers(0, 10_000), st.integers(1, 64))
def test_slot_of_is_the_block_table_formula(block: int, pos: int, bs: int) -> None:
    slot = slot_of(block, pos, bs)
    assert divmod(slot, bs) == (block, pos % bs)


@given(st.integers(1, 10_000), st.integers(1, 64))
def test_max_cacheable_tokens_spares_the_last_token(n: int, bs: int) -> None:
    m = max_cacheable_tokens(n, bs)
    assert m % bs == 0 and 0 <= m <= n - 1 and n - 1 - m < bs


@given(
    st.integers(0, 500), st.integers(0, 500), st.integers(1, 32), st.booleans(), st.integers(0, 500)
)
def test_chunk_size_bounds(remaining: int, budget: int, bs: int, align: bool, done: int) -> None:
    n = chunk_size(remaining, budget, bs, align, done)
    assert 0 <= n <= min(remaining, budget)
    if align and n not in (0, remaining):
        assert (done + n) % bs == 0
    if not align:
        assert n == min(remaining, budget)


# ---------------------------------------------------------------- unit: hashing
def test_root_key_is_stable() -> None:
    """The key scheme is part of stored traces; changing it must be deliberate."""
    root = DEFAULT_NAMESPACE.root_key()
    # v2: each field as its UTF-8 length (8 bytes, little-endian) then its bytes.
    payload = b"refserve-prefix-v2\x00" + (7).to_bytes(8, "little") + b"default" + bytes(16)
    assert root == hashlib.sha256(payload).digest()
    assert root.hex().startswith("880a36808479af7a")
    assert block_key(root, [1, 2, 3, 4]).hex().startswith("f52f91c69824f602")


def test_namespaces_have_distinct_roots() -> None:
    roots = {
        Namespace().root_key(),
        Namespace(model="m2").root_key(),
        Namespace(adapter="lora").root_key(),
        Namespace(cache_salt="salt").root_key(),
        Namespace(adapter="a", cache_salt="").root_key(),
        Namespace(adapter="", cache_salt="a").root_key(),
    }
    assert len(roots) == 6  # the last two differ only in which field holds "a"


def test_block_key_depends_on_parent_and_every_token() -> None:
    root = DEFAULT_NAMESPACE.root_key()
    k = block_key(root, [1, 2, 3, 4])
    assert block_key(root, (1, 2, 3, 4)) == k  # sequence type does not matter
    assert block_key(root, [1, 2, 3, 5]) != k
    assert block_key(root, [4, 3, 2, 1]) != k
    assert block_key(Namespace(adapter="x").root_key(), [1, 2, 3, 4]) != k
    assert block_key(root, [-1]) != block_key(root, [2**64 - 1 - 2**63])  # signed packing
    assert block_key(root, [256]) != block_key(root, [1, 0])


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=24),
    st.integers(1, 4),
    st.data(),
)
def test_chain_keys_differ_after_any_earlier_difference(
    toks: list[int], bs: int, data: st.DataObject
) -> None:
    nblocks = len(toks) // bs
    root = DEFAULT_NAMESPACE.root_key()
    keys = chain_keys(root, toks, bs, nblocks)
    assert len(keys) == nblocks
    assert len(set(keys)) == nblocks
    if nblocks == 0:
        return
    j = data.draw(st.integers(0, nblocks * bs - 1), label="changed position")
    other = list(toks)
    other[j] += 1
    keys2 = chain_keys(root, other, bs, nblocks)
    first = j // bs
    assert keys2[:first] == keys[:first]
    assert all(a != b for a, b in zip(keys[first:], keys2[first:], strict=True))
    salted = chain_keys(Namespace(cache_salt="s").root_key(), toks, bs, nblocks)
    assert all(a != b for a, b in zip(keys, salted, strict=True))


def test_chain_keys_match_block_key_and_refuse_short_input() -> None:
    root = DEFAULT_NAMESPACE.root_key()
    k1 = block_key(root, [1, 2])
    assert chain_keys(root, [1, 2, 3, 4, 5], 2, 2) == [k1, block_key(k1, [3, 4])]
    assert chain_keys(root, [1], 2, 0) == []
    with pytest.raises(ValueError, match="2 blocks of 2 need 4 tokens, got 3"):
        chain_keys(root, [1, 2, 3], 2, 2)
