"""Tokenizers, incremental detokenization and stop strings.

The default is :class:`ByteTokenizer`: ids 0-255 are the bytes of the UTF-8 text, then
three specials (BOS 256, EOS 257, PAD 258). :class:`HFTokenizer` adapts a local
``tokenizer.json`` through the ``tokenizers`` package (imported only when used; never
reaches the network).

Streaming text is produced by a :class:`Detokenizer` per sequence: it returns only text
that is complete, so a multi-byte character split across tokens is never emitted in
halves. :class:`TextStream` adds stop strings on top: text that could still turn out to
be the beginning of a stop string is held back until it cannot.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from refserve.errors import InvalidArgument, RefserveError


class TokenizerError(RefserveError):
    """A tokenizer could not be loaded or used."""


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text that became complete."""
        ...

    def flush(self) -> str:
        """At the end of the sequence: whatever is still pending (maybe U+FFFD)."""
        ...


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped."""
        ...

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, plus BOS (256), EOS (257) and PAD (258)."""

    NUM_BYTES = 256
    BOS = 256
    EOS = 257
    PAD = 258

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def bos_token_id(self) -> int:
        return self.BOS

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        data = bytes(t for t in token_ids if 0 <= t < self.NUM_BYTES)
        return data.decode("utf-8", errors="replace")

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer:
        return _ByteDetokenizer()


class _ByteDetokenizer:
    """An incremental UTF-8 decoder: a character is emitted once all its bytes are in."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        if not 0 <= token_id < ByteTokenizer.NUM_BYTES:
            return ""  # special tokens are not text
        return str(self._decoder.decode(bytes((token_id,))))

    def flush(self) -> str:
        return str(self._decoder.decode(b"", final=True))


class HFTokenizer:
    """A local ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(
        self,
        path: str | Path,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        try:
            import tokenizers
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise TokenizerError(
                "loading a tokenizer.json needs the 'tokenizers' package (pip install tokenizers)"
            ) from e
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise TokenizerError(f"tokenizer file not found: {p}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:
            raise TokenizerError(f"cannot read tokenizer {p}: {e}") from e
        self._bos = bos_token_id
        self._eos = eos_token_id

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer:
        return OffsetDetokenizer(self, prompt_token_ids)


class OffsetDetokenizer:
    """Incremental detokenization for any tokenizer with a ``decode`` (vLLM's method).

    Text is decoded over a short window of context tokens (so that leading spaces and
    merges come out as they would in a full decode); new text is emitted only when it
    grows and does not end in U+FFFD, the sign of an incomplete byte sequence.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_token_ids[-self.CONTEXT - 1 :])
        self._prefix = max(len(self._ids) - self.CONTEXT, 0)
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            # Keep the window bounded: earlier ids no longer affect the output.
            if self._prefix > 4 * self.CONTEXT:
                cut = self._prefix - self.CONTEXT
                del self._ids[:cut]
                self._prefix -= cut
                self._read -= cut
            return delta
        return ""


class TextStream:
    """One sequence's output text: detokenized incrementally, cut at a stop string.

    ``take()`` returns the text not yet handed out, except for a tail that could still
    be the start of a stop string (held back until the next token decides).
    """

    def __init__(
        self,
        detokenizer: Detokenizer,
        stop: Sequence[str] = (),
        *,
        include_stop_str_in_output: bool = False,
    ) -> None:
        for s in stop:
            if not isinstance(s, str) or not s:
                raise InvalidArgument(f"stop strings must be non-empty str, got {s!r}")
        self._detok = detokenizer
        self._stop = tuple(stop)
        self._include = include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped_by: str | None = None

    def add(self, token_id: int) -> bool:
        """Feed a token; True when the text now contains a stop string (text is cut)."""
        if self.stopped_by is not None:
            return True
        before = len(self.text)
        self.text += self._detok.add(token_id)
        return self._check(before)

    def finish(self) -> None:
        """The sequence ended for another reason: decode what is pending."""
        if self.stopped_by is None:
            before = len(self.text)
            self.text += self._detok.flush()
            self._check(before)

    @property
    def emitted_text(self) -> str:
        """The text handed out by :meth:`take` so far."""
        return self.text[: self._emitted]

    def mark_delivered(self, num_chars: int) -> None:
        """The first ``num_chars`` characters were handed out elsewhere (a migrated
        sequence's stream, rebuilt from its tokens: docs/MIGRATION.md)."""
        if not 0 <= num_chars <= len(self.text):
            raise InvalidArgument(
                f"mark_delivered: {num_chars} characters of a {len(self.text)}-character text"
            )
        self._emitted = num_chars

    def take(self, *, final: bool) -> str:
        end = (
            len(self.text)
            if final or self.stopped_by is not None
            else len(self.text) - self._holdback
        )
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def _check(self, before: int) -> bool:
        if not self._stop:
            return False
        start = max(0, before - self._holdback)
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self._include else self.text[:i]
        self.stopped_by = s
        return True
