"""A hybrid request migrated with its K/V between two engines on the GROUPED KV pool is
token-for-token transformers'.

The model is the ``hybrid`` oracle (conftest.py; sliding:full 1:1 with a window of 8 and
5:1 with a window of 13). Both engines run it with ``grouped_kv=True`` and blocks of 4,
with different token budgets. A request with a 30-token prompt decodes 10 tokens on the
source, whose window group has released blocks by then, and moves by transfer (inline
in the ticket, and streamed two blocks at a time): each layer's K/V is read from its own
group's slots, a window layer's only from its group's first held place (so fewer bytes
travel than the plain pool's every-layer-every-position), and written into the
destination's restored tables, whose window places before the window are null too. The
rest of its outputs come from the destination and equal ``generate(do_sample=False)``.
A grouped ticket survives its encoding (version 3, naming the layout). A turn paused
for a tool with its K/V on the source's host moves the same way, from the host cache,
and its next turn is transformers' continuation.

The checks can fail: with the source planted to read the window layers' rows from the
first group's slots, the tokens are not transformers'. A plain source and a grouped
destination (and the reverse) refuse a transfer, naming the two layouts; ``auto``
moves the request by recompute instead, and its tokens are transformers'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from hf_oracle import VOCAB, HFOracle, random_prompt

from refserve.core import transit as transit_module
from refserve.core.config import SchedulerConfig
from refserve.core.migration_cost import MigrationCost
from refserve.core.transit import Departure, GroupSlots
from refserve.engine import migration
from refserve.engine.llm_engine import LLMEngine
from refserve.engine.ticket import GROUPED_TICKET_VERSION, MigrationTicket
from refserve.kv.groups import GroupedPool
from refserve.model.sampler import SamplingParams
from refserve.spec.groups import NULL_BLOCK

PROMPT, OUT, MOVE_AT = 30, 24, 10


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # Two cores are shared: one torch thread keeps the runs' time steady.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def engine(hybrid: HFOracle, budget: int, *, grouped: bool = True) -> LLMEngine:
    cfg = SchedulerConfig(block_size=4, max_num_batched_tokens=budget)
    return LLMEngine(
        str(hybrid.path), scheduler_config=cfg, grouped_kv=grouped, check_invariants=True
    )


def null_places(e: LLMEngine, rid: str) -> int:
    pool = e.scheduler.pool
    assert isinstance(pool, GroupedPool)
    return sum(list(t).count(NULL_BLOCK) for t in pool.block_tables(rid))


def start(e: LLMEngine, prompt: list[int]) -> tuple[str, list[int]]:
    """The request added and decoded to ``MOVE_AT`` output tokens."""
    rid = e.add_request(prompt, SamplingParams(max_tokens=OUT), request_id="m")
    tokens: list[int] = []
    while len(tokens) < MOVE_AT:
        for out in e.step():
            tokens.extend(out.new_token_ids)
    return rid, tokens


def finish(e: LLMEngine, tokens: list[int]) -> tuple[int, ...]:
    while e.has_unfinished:
        for out in e.step():
            tokens.extend(out.new_token_ids)
    return tuple(tokens)


def prompt_of(seed: int) -> list[int]:
    return random_prompt(torch.Generator().manual_seed(seed), PROMPT)


@pytest.mark.parametrize("chunk_blocks", [None, 2], ids=["inline", "streamed"])
def test_transfer_between_grouped_engines_matches_transformers(
    hybrid: HFOracle, chunk_blocks: int | None
) -> None:
    src, dst = engine(hybrid, 5), engine(hybrid, 16)
    prompt = prompt_of(21)
    rid, tokens = start(src, prompt)
    assert null_places(src, rid) > 0, "the window group released blocks before the move"
    ticket = src.export_request(rid, kv="transfer")
    assert ticket.version == GROUPED_TICKET_VERSION and ticket.kv_layout == "full,window:" + str(
        hybrid.config.sliding_window
    )
    assert MigrationTicket.from_bytes(ticket.to_bytes()) == ticket
    kv_length = ticket.sequences[0].state.num_computed_tokens
    report = migration.migrate(src, dst, rid, kv="transfer", chunk_blocks=chunk_blocks)
    assert report.decision.mode.value == "transfer"
    # The window layers' positions before their group's first held place stay behind.
    assert 0 < report.kv_bytes < kv_length * ticket.model.bytes_per_token
    assert not src.scheduler.requests
    assert null_places(dst, rid) > 0, "the destination's window places before it are null"
    assert finish(dst, tokens) == hybrid.greedy(prompt, OUT)


def test_window_rows_read_from_the_first_groups_slots_change_the_tokens(
    hybrid: HFOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = transit_module.export

    def wrong_group(sched: object, request_id: str) -> Departure:
        d = real(sched, request_id)  # type: ignore[arg-type]
        if not d.groups:
            return d
        first = d.groups[0]
        planted = tuple(GroupSlots(g.group, g.start, first.slots[g.start :]) for g in d.groups)
        return dataclasses.replace(d, groups=planted)

    src, dst = engine(hybrid, 5), engine(hybrid, 16)
    prompt = prompt_of(21)
    rid, tokens = start(src, prompt)
    monkeypatch.setattr(transit_module, "export", wrong_group)
    migration.migrate(src, dst, rid, kv="transfer")
    monkeypatch.undo()
    assert finish(dst, tokens) != hybrid.greedy(prompt, OUT)


@pytest.mark.parametrize("grouped_src", [False, True], ids=["plain-to-grouped", "grouped-to-plain"])
def test_other_layouts_refuse_a_transfer_and_auto_recomputes(
    hybrid: HFOracle, grouped_src: bool
) -> None:
    src = engine(hybrid, 5, grouped=grouped_src)
    dst = engine(hybrid, 16, grouped=not grouped_src)
    prompt = prompt_of(22)
    rid, tokens = start(src, prompt)
    with pytest.raises(migration.KVLayoutRefused, match="the layouts differ"):
        migration.migrate(src, dst, rid, kv="transfer")
    assert src.scheduler.requests and not dst.scheduler.requests
    # A link this fast makes the rule choose a transfer, which the destination refuses.
    fast = MigrationCost(kv_bytes_per_token=src.cache.bytes_per_token, link_gb_per_s=1e6)
    report = migration.migrate(src, dst, rid, kv="auto", cost=fast)
    assert report.decision.mode.value == "recompute"
    assert finish(dst, tokens) == hybrid.greedy(prompt, OUT)


def test_a_tool_wait_on_the_host_moves_by_transfer(hybrid: HFOracle) -> None:
    """A turn paused with its K/V on the source's host (each group's held blocks, the
    window group's from its first held place) moves by transfer from the host cache,
    and its next turn is transformers' continuation."""
    g = torch.Generator().manual_seed(23)
    prompt = random_prompt(g, 21)
    tool = torch.randint(3, VOCAB, (5,), generator=g).tolist()
    cfg = SchedulerConfig(block_size=4, max_num_batched_tokens=16, num_host_blocks=32)
    src = LLMEngine(str(hybrid.path), scheduler_config=cfg, grouped_kv=True, check_invariants=True)
    dst = engine(hybrid, 16)
    rid = src.add_request(prompt, SamplingParams(max_tokens=40), request_id="a")
    turn1: list[int] = []
    while len(turn1) < 10:
        turn1 += [t for o in src.step() for t in o.new_token_ids]
    src.pause(rid, "host")
    src.step()
    host = src.scheduler.host
    assert host.has_request(rid) and host.table(rid).groups[1].first > 0
    report = migration.migrate(src, dst, rid, kv="transfer", chunk_blocks=1)
    assert report.decision.mode.value == "transfer" and report.num_chunks > 0
    assert null_places(dst, rid) > 0
    dst.resume(rid, tool, SamplingParams(max_tokens=8))
    turn2: list[int] = []
    assert finish(dst, turn2) == hybrid.greedy([*prompt, *turn1, *tool], 8)
    assert tuple(turn1) == hybrid.greedy(prompt, 10)
