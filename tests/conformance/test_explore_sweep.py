"""A scope of the user's own and the boundary sweep (conformance/explore/scope.py, sweep.py;
docs/CONFORMANCE.md, "Your own scope and the boundary sweep").

A named scope sits at one budget and one pool size, so a check off by one at another
boundary passes every exhaustive run. The indie engine without chunked prefill, with its
admission planted one token short (``whole_prompt_off_by_one``), passes every named scope
and is caught by the sweep; the correct engine passes the whole sweep. A user's scope is
read from JSON or ``--scope-set`` pairs, and a wrong field is named.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import indie_adapter
import pytest

from refserve.conformance.adapter import Feature
from refserve.conformance.adapters.ref import make
from refserve.conformance.cli import conformance_main
from refserve.conformance.explore import SCOPES, ScopeError, explore, explore_sweep, user_scope
from refserve.conformance.explore.scope import (
    RequestTemplate,
    block_needs,
    boundaries,
    parse_catalogue,
    sequence_need,
    sweep,
)
from refserve.conformance.workload import RequestPlan, Workload

UNCHUNKED = SCOPES["small-unchunked"]
# The sweeps below bound a path to two adds (the named scope allows three): the same 54
# points and the same 8 failing ones, in a fifth of the time (docs/CONFORMANCE.md).
SWEPT = user_scope({"max_requests": 2}, UNCHUNKED)
BUGGY = indie_adapter.make_unchunked_whole_prompt_off_by_one


def test_the_unchunked_indie_engine_declares_no_chunking() -> None:
    assert Feature.CHUNKED_PREFILL not in indie_adapter.make_unchunked().features
    assert Feature.CHUNKED_PREFILL in indie_adapter.make().features


def test_the_needs_of_a_request_are_its_longest_step_and_its_longest_table() -> None:
    t = RequestTemplate((2, 3, 4, 5, 6, 7, 8), 3)
    assert sequence_need(t) == 9  # a recompute: the prompt and two of the three outputs
    assert block_needs(t, 2) == (5, 5)
    assert block_needs(RequestTemplate((2, 3, 4), 2), 2) == (2, 3)  # the slot ahead: one more


def test_without_chunking_the_last_output_is_never_in_a_step() -> None:
    """A request that stops at its last output never recomputes it: a budget of prompt +
    max_tokens - 1 is enough without chunked prefill, one less is not."""
    plan = RequestPlan("r", (2, 3, 4, 5), 3)
    cfg = UNCHUNKED.config()
    fits = Workload(dataclasses.replace(cfg, max_num_batched_tokens=6), (plan,))
    short = Workload(dataclasses.replace(cfg, max_num_batched_tokens=5), (plan,))
    assert Feature.CHUNKED_PREFILL not in fits.needs()
    assert Feature.CHUNKED_PREFILL in short.needs()


def test_the_boundaries_surround_every_need() -> None:
    edges = boundaries(UNCHUNKED)
    needs = {sequence_need(t) for t in UNCHUNKED.catalogue}
    assert needs == {2, 5, 6, 9}
    assert edges.budgets == (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    assert edges.pools == (1, 2, 3, 4, 5, 6)
    assert UNCHUNKED.max_num_batched_tokens in edges.budgets  # the named point is swept too


def test_an_unchunked_sweep_keeps_at_each_budget_the_requests_that_fit() -> None:
    points = sweep(UNCHUNKED, chunked=False)
    at_six = [p for p in points if p.max_num_batched_tokens == 6]
    assert at_six and all(len(p.catalogue) == 4 for p in at_six)  # the 9-token recompute out
    assert all(sequence_need(t) <= p.max_num_batched_tokens for p in points for t in p.catalogue)
    assert not any(p.max_num_batched_tokens == 1 for p in points)  # no request fits one token
    assert len(sweep(UNCHUNKED)) == 10 * 6  # chunked: every point, the whole catalogue


def test_the_named_scopes_miss_the_off_by_one_and_the_sweep_catches_it() -> None:
    for name, scope in SCOPES.items():
        res = explore(BUGGY, scope, strategy="copy", first_only=True)
        assert not res.counterexamples, (name, res.summary())
    swept = explore_sweep(BUGGY, SWEPT, strategy="copy")
    assert not swept.chunked and len(swept.points) == 54 and swept.failing, swept.summary()
    found = {
        (p.scope.max_num_batched_tokens, c.finding.invariant.value)
        for p in swept.failing
        if p.scope
        for c in p.counterexamples
    }
    # A 6-token prompt with one output, at a budget of exactly 6: never admitted.
    assert (6, "PROGRESS") in found, found


def test_the_correct_engines_pass_the_sweep() -> None:
    indie = explore_sweep(indie_adapter.make_unchunked, SWEPT, strategy="copy")
    assert not indie.failing and not indie.not_supported, indie.summary()
    assert all(p.exhausted for p in indie.points), indie.summary()
    ours = explore_sweep(make, SCOPES["tiny"], strategy="copy")
    assert ours.chunked and not ours.failing and len(ours.points) == 24, ours.summary()


# ------------------------------------------------------------------ the user's scope
def test_a_scope_from_json_fields() -> None:
    scope = user_scope(
        {
            "name": "mine",
            "block_size": 2,
            "num_blocks": 3,
            "budget": 4,
            "max_seqs": 2,
            "catalogue": [{"prompt": [2, 3, 4], "max_tokens": 2}, {"prompt": [5], "max_tokens": 1}],
        }
    )
    assert (scope.name, scope.max_num_batched_tokens, scope.max_requests) == ("mine", 4, 2)
    assert scope.catalogue[1] == RequestTemplate((5,), 1)


def test_scope_set_pairs_change_a_named_scope() -> None:
    scope = user_scope({"budget": "3", "catalogue": "2,3,4:2 2,3,5:2:-1"}, SCOPES["small"])
    assert scope.name == "small+user" and scope.max_num_batched_tokens == 3
    assert scope.catalogue == (RequestTemplate((2, 3, 4), 2), RequestTemplate((2, 3, 5), 2, -1))
    assert scope.max_requests == 2  # the base's 3, as far as two requests allow
    assert scope.num_blocks == SCOPES["small"].num_blocks  # the rest is the base's


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"budgett": 3}, "unknown scope field 'budgett'"),
        ({"budget": "many"}, "max_num_batched_tokens must be an integer"),
        ({"budget": 0}, "max_num_batched_tokens must be >= 1"),
        ({"budget": True}, "max_num_batched_tokens must be an integer"),
        ({"faults": "maybe"}, "faults must be true or false"),
        ({"catalogue": "2,3:"}, "catalogue: '2,3:' holds a value that is not an integer"),
        ({"catalogue": "2,3"}, "catalogue: '2,3' is not PROMPT:MAX_TOKENS[:PRIORITY]"),
        ({"catalogue": "1,3:2"}, "catalogue: prompt must be a non-empty tuple of token ids >= 2"),
        ({"catalogue": [{"prompt": [2], "max_tokens": 1, "x": 1}]}, "catalogue[0]: unknown key"),
        ({"catalogue": [{"prompt": "23", "max_tokens": 1}]}, "catalogue[0].prompt must be a list"),
        ({"max_requests": 9}, "max_requests must be in 1..5"),
        ({"name": ""}, "name must be a non-empty string"),
    ],
)
def test_a_wrong_field_is_named(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ScopeError, match=named.replace("[", r"\[").replace("(", r"\(")):
        user_scope(fields, SCOPES["small"])


def test_a_scope_without_a_base_must_give_the_limits() -> None:
    with pytest.raises(ScopeError, match="the scope lacks catalogue, block_size"):
        user_scope({"num_blocks": 3})
    assert parse_catalogue("2,3:1;4:2") == (RequestTemplate((2, 3), 1), RequestTemplate((4,), 2))


# ------------------------------------------------------------------ from the command line
def _cli(*args: str) -> int:
    return conformance_main(["--no-progress", *args])


def test_the_command_line_sweeps_a_users_scope_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "scope.json"
    path.write_text(
        json.dumps(
            {
                "name": "edge",
                "block_size": 2,
                "num_blocks": 4,
                "budget": 8,
                "max_seqs": 2,
                "catalogue": "2,3,4:2 5,6,7,8,9,10:1",
            }
        )
    )
    adapter = "indie_adapter:make_unchunked_whole_prompt_off_by_one"
    report = tmp_path / "sweep.json"
    base = ["--adapter", adapter, "--exhaustive", "--strategy", "copy", "--scope", str(path)]
    assert _cli(*base) == 0  # at budget 8 the off-by-one never shows
    capsys.readouterr()
    assert _cli(*base, "--sweep", "--report", str(report)) == 1
    out = capsys.readouterr().out
    assert "boundary sweep of scope edge" in out and "edge@budget=6" in out
    assert "FAIL safety" in out and "[PROGRESS]" in out
    data = json.loads(report.read_text())
    assert data["format"] == "refserve-explore-sweep" and data["chunked"] is False
    assert any(p["counterexamples"] for p in data["points"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--scope", "nope"), "--scope must be one of"),
        (("--scope-set", "budget"), "--scope-set wants FIELD=VALUE"),
        (("--scope-set", "budgett=3"), "--scope: unknown scope field 'budgett'"),
        (("--scope", "{tmp}/bad.json"), "not valid JSON"),
        (("--scope", "{tmp}/list.json"), "a scope is a JSON object"),
        (("--scope", "{tmp}/missing.json"), "--scope {tmp}/missing.json"),
    ],
)
def test_a_bad_scope_is_a_usage_error(
    args: tuple[str, ...], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "list.json").write_text("[]")
    args = tuple(a.replace("{tmp}", str(tmp_path)) for a in args)
    rc = _cli("--adapter", "indie_adapter:make", "--exhaustive", *args)
    err = capsys.readouterr().err
    assert rc == 2 and message.replace("{tmp}", str(tmp_path)) in err, err


def test_a_sweep_too_large_to_finish_is_refused_with_its_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lengths = " ".join(f"{','.join(['2'] * n)}:1" for n in range(1, 41))  # 40 lengths
    args = ("--exhaustive", "--scope", "tiny", "--scope-set", f"catalogue={lengths}", "--sweep")
    assert _cli("--adapter", "indie_adapter:make", *args) == 2
    err = capsys.readouterr().err
    assert "the sweep would explore" in err and "more than 400" in err, err
    with pytest.raises(ScopeError, match="more than 400"):
        sweep(user_scope({"catalogue": lengths}, SCOPES["tiny"]))


def test_sweep_and_scope_set_need_an_engine_exploration(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("--adapter", "indie_adapter:make", "--sweep") == 2
    assert "add --exhaustive" in capsys.readouterr().err
    kv = ("--kv-adapter", "indie_adapter:make_kv", "--exhaustive", "--sweep")
    assert _cli(*kv) == 2
    assert "use them with --adapter" in capsys.readouterr().err
