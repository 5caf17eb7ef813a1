"""The new commands under the one error surface: bad options are one ``refserve: error:``
line and exit 2, before any model loads or any request is sent; and the chat templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from refserve.cli.main import main
from refserve.serve.chat import (
    BYTE_TEMPLATE,
    ChatMessageText,
    ChatTemplateError,
    load_chat_template,
)

BAD: list[tuple[str, list[str], str]] = [
    ("serve port", ["serve", "--port", "70000"], "--port"),
    ("serve max-waiting", ["serve", "--max-waiting", "0"], "--max-waiting"),
    ("serve drain", ["serve", "--drain-timeout", "nan"], "--drain-timeout"),
    ("serve threads", ["serve", "--torch-threads", "0"], "--torch-threads"),
    ("serve api key", ["serve", "--api-key", "has space"], "--api-key"),
    ("serve device", ["serve", "--device", "tpu"], "--device"),
    ("serve restarts", ["serve", "--max-replica-restarts", "-1"], "--max-replica-restarts"),
    ("serve restarts type", ["serve", "--max-replica-restarts", "2.5"], "--max-replica-restarts"),
    ("serve mlfq queues", ["serve", "--policy", "mlfq", "--mlfq-queues", "99"], "--mlfq-queues"),
    ("serve mlfq growth", ["serve", "--policy", "mlfq", "--mlfq-growth", "nan"], "--mlfq-growth"),
    ("serve mlfq starvation", ["serve", "--policy", "mlfq", "--mlfq-starvation-steps", "0"],
     "starvation_steps"),
    ("bench rate", ["bench-serve", "--model", "m", "--rate", "nan"], "--rate"),
    ("bench sweep", ["bench-serve", "--model", "m", "--sweep", ","], "--sweep"),
    ("bench trace", ["bench-serve", "--model", "m", "--trace", "nope"], "--trace"),
    ("bench both", ["bench-serve", "--model", "m", "--num-requests", "1", "--duration", "1"],
     "--duration"),
    ("bench url", ["bench-serve", "--model", "m", "--base-url", "localhost:8000"], "--base-url"),
    ("bench inf duration", ["bench-serve", "--model", "m", "--rate", "inf", "--duration", "1"],
     "--duration"),
    ("conf checks", ["conformance-http", "--model", "tiny", "--checks", "nope"], "--checks"),
    ("conf timeout", ["conformance-http", "--model", "tiny", "--timeout", "-1"], "--timeout"),
    ("conf model", ["conformance-http"], "--model"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "argv", "names"), BAD, ids=[c for c, _, _ in BAD])
def test_bad_options_are_one_line(case: str, argv: list[str], names: str, capsys: Any) -> None:
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("refserve: error:") and out.err.count("\n") == 1, out.err
    assert names in out.err and "Traceback" not in out.err


def test_conformance_http_lists_its_checks(capsys: Any) -> None:
    assert main(["conformance-http", "--model", "tiny", "--list"]) == 0
    names = capsys.readouterr().out.split()
    assert names[:2] == ["models", "greedy"] and "stop_string" in names


def test_byte_template() -> None:
    t = load_chat_template(None)
    assert t.source == BYTE_TEMPLATE and t.add_special_tokens
    text = t.render([ChatMessageText("system", "Be brief."), ChatMessageText("user", "Hi")])
    assert text == "system: Be brief.\nuser: Hi\nassistant:"


def test_template_from_tokenizer_config(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    cfg = {"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_chat_template(tmp_path)
    assert not t.add_special_tokens  # the template writes its own BOS
    assert t.render([ChatMessageText("user", "Hi")]) == "<s><|user|>Hi</s><|assistant|>"


def test_template_errors_are_typed(tmp_path: Path) -> None:
    bad = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": bad}))
    t = load_chat_template(tmp_path)
    assert t.render([ChatMessageText("user", "x")]) == "ok"
    with pytest.raises(ChatTemplateError, match="user first"):
        t.render([ChatMessageText("assistant", "x")])
    # The sandbox: a template cannot reach Python internals.
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": escape}))
    with pytest.raises(ChatTemplateError):
        load_chat_template(tmp_path).render([ChatMessageText("user", "x")])
