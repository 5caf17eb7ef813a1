"""Chat templates: messages to prompt text.

A checkpoint directory whose ``tokenizer_config.json`` has a ``chat_template`` (a jinja2
string, or a list of named templates of which ``default`` is used) is rendered with that
template in jinja2's sandbox, as transformers does: ``messages``,
``add_generation_prompt=True``, ``bos_token`` / ``eos_token`` from the same file. The
rendered text already holds any BOS the template wants, so it is encoded without adding
special tokens.

The byte tokenizer has no template of its own; refserve uses :data:`BYTE_TEMPLATE`, one
line per message ``<role>: <content>`` and then ``assistant:`` for the model to continue,
encoded with the tokenizer's BOS in front. It is documented in docs/GUIDE.md; it is a
convention, not something the embedded models were trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from refserve.errors import InvalidArgument

BYTE_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(InvalidArgument):
    """The template could not render these messages (or could not be read)."""


@dataclass(frozen=True)
class ChatMessageText:
    role: str
    content: str


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str
    #: Whether the rendered text gets the tokenizer's special tokens (the byte template
    #: does: it writes no BOS itself).
    add_special_tokens: bool
    origin: str

    def render(self, messages: list[ChatMessageText]) -> str:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:  # what HF templates call on bad input
            raise ChatTemplateError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.source).render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template ({self.origin}) failed: {e}") from None


def _special(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def load_chat_template(model_dir: Path | None) -> ChatTemplate:
    """The template of ``model_dir``'s ``tokenizer_config.json``, else the byte template."""
    byte = ChatTemplate(BYTE_TEMPLATE, "", "", True, "refserve byte template")
    if model_dir is None:
        return byte
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return byte
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path}: cannot read: {e}") from None
    if not isinstance(cfg, dict):
        return byte
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        return byte
    return ChatTemplate(
        template, _special(cfg.get("bos_token")), _special(cfg.get("eos_token")), False, str(path)
    )
