"""A token's raw bytes (chat logprobs' `bytes`): a character split over several tokens is
rebuilt from its tokens' bytes, though each token's text alone is U+FFFD."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from runtime.request import TokenLogprob
from runtime.tokenizer import Tokenizer

TEXT = "🍎 café naïve 👋"


def test_byte_level_tokens_rebuild_split_characters(default_model_dir: Any) -> None:
    tok = Tokenizer.from_dir(default_model_dir)
    ids = tok.encode(TEXT)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode("utf-8") == TEXT
    # Some token is part of a character: its text is U+FFFD, its bytes are not.
    split = [i for i in ids if tok.decode([i], skip_special_tokens=False) == "\ufffd"]
    assert split and all(tok.token_bytes(i) != "\ufffd".encode() for i in split)
    eos = tok.eos_token_ids[0]
    assert tok.token_bytes(eos) == tok.decode([eos], skip_special_tokens=False).encode()


def _sentencepiece_dir(tmp_path: Path) -> Path:
    """A SentencePiece-style tokenizer: "▁" for spaces, byte fallback for what the vocabulary
    lacks (as Llama 2's)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab.update({"▁": 257, "h": 258, "i": 259, "▁h": 260, "▁hi": 261})
    merges = [("▁", "h"), ("▁h", "i")]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_sentencepiece_byte_fallback_pieces_are_their_bytes(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_sentencepiece_dir(tmp_path))
    ids = tok.encode("hi é")
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == " hi é".encode()  # the leading "▁" is a space
    assert [tok.id_to_token(i) for i in ids][-2:] == ["<0xC3>", "<0xA9>"]
    assert pieces[-2:] == [b"\xc3", b"\xa9"]


def test_chat_logprob_entries_carry_the_tokens_bytes(default_model_dir: Any) -> None:
    from app.routes_openai import _chat_logprobs

    tok = Tokenizer.from_dir(default_model_dir)
    engine = SimpleNamespace(tokenizer=tok)
    ids = tok.encode("👋🍎")
    items = [TokenLogprob(token_id=i, logprob=-0.5, top=[(i, -0.5)]) for i in ids]
    content = _chat_logprobs(engine, items)["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == "👋🍎"
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)
