"""``refserve generate --migrate-every K`` (ref/cli/migrate.py, docs/MIGRATION.md):
the request moves between engines A and B every K steps, each move is reported, and the
command's own check holds the output to an unmigrated run's.

Run in process like the other CLI tests. The output is also compared here with a plain
``refserve generate`` of the same prompt (not only with the command's verdict), and a
planted bug in the K/V sent is shown to make the command fail with exit 1.
"""

from __future__ import annotations

import json
import re

import pytest

import refserve.engine.migration as engine_migration
from refserve.cli.main import main
from refserve.engine.ticket import KVChunk

PROMPT = ("--prompt", "Count to four.", "--max-tokens", "8")
MOVE = re.compile(
    r"^\[step +(\d+)\] ([AB]) -> ([AB])  (.+?) \| (transfer|recompute)[^|]* \| "
    r"KV (\d+) tokens: (\d+) cached on \3, (\d+) (copied|to recompute) \| ([\d,]+) B",
    re.M,
)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out


def _tokens(out: str) -> list[str]:
    return re.findall(r"^(?:\[\d\] )?tokens: (.*)$", out, re.M)


def test_moves_are_reported_and_the_output_is_the_unmigrated_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, plain = _run([*PROMPT, "--max-num-batched-tokens", "8"], capsys)
    assert code == 0
    argv = [*PROMPT, "--migrate-every", "1", "--migration-kv", "transfer"]
    code, out = _run(
        [*argv, "--migration-chunk-blocks", "1", "--block-size", "4", "--check"], capsys
    )
    assert code == 0, out[-2000:]
    moves = MOVE.findall(out)
    assert len(moves) >= 4, out
    # Every step a move, alternating, the first one mid-prefill (8 of 15 prompt tokens).
    assert [(int(m[0]), m[1], m[2]) for m in moves[:3]] == [
        (1, "A", "B"),
        (2, "B", "A"),
        (3, "A", "B"),
    ]
    assert moves[0][3] == "mid-prefill, 8/15 prompt tokens"
    for _step, _src, _dst, _state, mode, kv, hit, copied, _, sent in moves:
        assert mode == "transfer" and int(hit) + int(copied) == int(kv)
        # 1,536 bytes per token for the tiny model: only the missing positions travel.
        assert int(sent.replace(",", "")) == 1536 * int(copied)
    assert any(int(m[6]) > 0 for m in moves), "a move back found its blocks in the cache"
    assert "identical to the unmigrated run" in out and "NOT" not in out
    assert _tokens(out) == _tokens(plain) and len(_tokens(out)) == 1


def test_recompute_moves_of_a_sampled_n_2_request(capsys: pytest.CaptureFixture[str]) -> None:
    sampled = ["--n", "2", "--temperature", "0.9", "--seed", "3", "--max-num-batched-tokens", "8"]
    code, plain = _run([*PROMPT, *sampled], capsys)
    assert code == 0
    argv = [*PROMPT, *sampled, "--migrate-every", "2", "--migration-kv", "recompute"]
    code, out = _run(argv, capsys)
    assert code == 0, out[-2000:]
    moves = MOVE.findall(out)
    assert moves and {m[4] for m in moves} == {"recompute"}
    assert all(m[-1] == "0" for m in moves)  # nothing sent
    assert "(2 samples)" in out
    assert _tokens(out) == _tokens(plain) and len(_tokens(out)) == 2


def test_the_check_fails_when_the_kv_sent_is_wrong(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine_migration.read_kv

    def zeroed(*args: object, **kwargs: object) -> KVChunk:
        chunk = real(*args, **kwargs)  # type: ignore[arg-type]
        return KVChunk(chunk.seq_id, chunk.start, chunk.end, bytes(len(chunk.data)))

    monkeypatch.setattr(engine_migration, "read_kv", zeroed)
    argv = [*PROMPT, "--migrate-every", "2", "--migration-kv", "transfer"]
    code, out = _run(argv, capsys)
    assert code == 1
    assert MOVE.search(out)
    assert "NOT identical to the unmigrated run: sample 0: token " in out
    code, text = _run([*argv, "--json"], capsys)
    assert code == 1
    mig = json.loads(text)["migration"]
    assert mig["identical"] is False and mig["difference"].startswith("sample 0: token ")
    assert mig["moves"] and {m["kv_mode"] for m in mig["moves"]} == {"transfer"}
    assert all(m["hit_tokens"] + m["moved_tokens"] == m["kv_tokens"] for m in mig["moves"])
    assert [m["from"] for m in mig["moves"][:2]] == ["A", "B"]
