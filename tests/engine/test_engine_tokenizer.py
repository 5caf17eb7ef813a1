"""Byte tokenizer, incremental detokenization (never half a character), stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from refserve.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    OffsetDetokenizer,
    TextStream,
    TokenizerError,
)

TEXT = "héllo wörld — 你好 😀!"


def test_byte_tokenizer_roundtrip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id and max(ids[1:]) < 256
    assert tok.decode([*ids, tok.eos_token_id]) == TEXT
    assert tok.encode("a", add_special_tokens=False) == [97]


def test_incremental_detokenization_never_splits_a_character() -> None:
    tok = ByteTokenizer()
    detok = tok.detokenizer([tok.bos_token_id])
    pieces = [detok.add(t) for t in tok.encode(TEXT, add_special_tokens=False)]
    assert "".join(pieces) == TEXT
    for p in pieces:
        assert "\ufffd" not in p
    # 😀 is 4 bytes: three tokens give nothing, the fourth gives the whole character.
    assert pieces[-5:-1] == ["", "", "", "😀"]
    assert detok.flush() == ""


def test_incomplete_tail_is_flushed_as_replacement() -> None:
    detok = ByteTokenizer().detokenizer([])
    assert detok.add(0xE4) == "" and detok.add(0xBD) == ""
    assert detok.flush() == "\ufffd"


def test_stop_string_across_tokens_and_holdback() -> None:
    tok = ByteTokenizer()
    stream = TextStream(tok.detokenizer([]), ["STOP", "x!"])
    emitted = []
    for t in tok.encode("abcST", add_special_tokens=False):
        assert not stream.add(t)
        emitted.append(stream.take(final=False))
    # "ST" might begin "STOP": held back (3 characters at most).
    assert "".join(emitted) == "ab"
    assert not stream.add(ord("O"))
    assert stream.add(ord("P"))
    assert stream.stopped_by == "STOP"
    assert stream.take(final=True) == "c"
    assert stream.text == "abc"


def test_stop_string_included_on_request() -> None:
    tok = ByteTokenizer()
    stream = TextStream(tok.detokenizer([]), ["lo"], include_stop_str_in_output=True)
    hits = [stream.add(t) for t in tok.encode("hello world", add_special_tokens=False)]
    assert hits.index(True) == 4
    assert stream.text == "hello"


def _byte_fallback_tokenizer(path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2}
    for i, b in enumerate(range(256)):
        vocab[f"<0x{b:02X}>"] = 3 + i
    for w in ["hello", "world", "▁"]:
        vocab.setdefault(w, len(vocab))
    t = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="[UNK]")
    )
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    t.add_special_tokens(["<s>", "</s>"])
    out = path / "tokenizer.json"
    t.save(str(out))
    return out


def test_hf_tokenizer_adapter_and_offset_detokenizer(tmp_path: Path) -> None:
    path = _byte_fallback_tokenizer(tmp_path)
    tok = HFTokenizer(path, bos_token_id=0, eos_token_id=1)
    assert tok.vocab_size >= 259
    ids = tok.encode("é😀 hello", add_special_tokens=False)
    assert len(ids) > 7  # byte fallback: é and 😀 are split over several tokens
    assert tok.decode(ids) == "é😀 hello"
    detok = OffsetDetokenizer(tok, [0])
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)
    for p in pieces:
        assert "\ufffd" not in p
    with pytest.raises(TokenizerError):
        HFTokenizer(tmp_path / "missing.json")
