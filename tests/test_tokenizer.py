"""Tokenizer, chat template (against transformers' rendering) and the streaming detokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from runtime.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "Zürich, 東京, São Paulo, Москва, 서울, القاهرة",
    "emoji: 🙂🚀👩‍👩‍👧 and math ∑∫√ and a tab\tand newline\n",
    "  leading spaces and <|im_start|> a special token inside",
    "def f(x):\n    return x ** 2  # 平方\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Wie geht's? 🙂"},
    ],
]


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def hf_tok(default_model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


def test_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"),)
    assert tok.id_to_token(tok.eos_token_ids[0]) == "<|im_end|>"


def test_encode_decode_match_transformers(tok: Tokenizer, hf_tok) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.encode_batch(TEXTS[:2]) == [tok.encode(t) for t in TEXTS[:2]]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(tok, hf_tok, conv, add_generation_prompt) -> None:
    messages = CONVERSATIONS[conv]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == ref
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_template_helpers(tok: Tokenizer) -> None:
    import tokenizers

    template = (
        "{% if messages|length == 0 %}{{ raise_exception('need messages') }}{% endif %}"
        "{% for m in messages %}{{ bos_token }}{{ m | tojson }}{% endfor %}"
    )
    t = Tokenizer(tokenizers.Tokenizer.from_str(tok._tok.to_str()), template, {"bos_token": "<s>"})
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '<s>{"role": "user", "content": "é"}'
    )
    with pytest.raises(ChatTemplateError, match="need messages"):
        t.apply_chat_template([])
    no_template = Tokenizer(tokenizers.Tokenizer.from_str(tok._tok.to_str()))
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])


def test_single_token_id(tok: Tokenizer) -> None:
    yes = tok.single_token_id(" yes")
    assert yes is not None and tok.decode([yes]) == " yes"
    assert tok.single_token_id("<|im_end|>") == tok.eos_token_ids[0]
    assert tok.single_token_id("definitely not one token") is None
    assert tok.single_token_id("") is None


def _stream(
    tok: Tokenizer, ids: list[int], rng: random.Random, window: bool = False, **kw
) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tok, **kw)
    assert detok._stream is not None  # a Hugging Face tokenizer: its DecodeStream
    if window:
        detok._stream = None  # the way of tokenizers without one
    deltas: list[str] = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text
    return detok.text, deltas


@pytest.mark.parametrize("window", [False, True], ids=["decode-stream", "window"])
def test_incremental_detokenizer_equals_full_decode(tok: Tokenizer, window: bool) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            streamed, deltas = _stream(tok, ids, rng, window, skip_special_tokens=skip)
            assert streamed == tok.decode(ids, skip_special_tokens=skip)
            # valid UTF-8 overall: no delta may carry a replacement char from a split character
            assert not any("\ufffd" in d for d in deltas)
    # random token sequences (may be invalid UTF-8: then U+FFFD appears in both)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        assert _stream(tok, ids, rng, window)[0] == tok.decode(ids)
    # random mixes of byte-fallback-heavy text
    alphabet = "aé東🙂 \nж"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        assert _stream(tok, tok.encode(text), rng, window)[0] == text


def test_detokenizer_holds_back_split_character(tok: Tokenizer) -> None:
    ids = tok.encode("🙂")
    assert len(ids) > 1  # byte-level BPE splits this emoji over several tokens
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) == ""  # incomplete UTF-8: nothing (and no U+FFFD) yet
    assert detok.add(ids[1:]) == "🙂"
    assert detok.finish() == ""


def test_detokenizer_with_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("The answer is")
    gen = tok.encode(" forty-two, ünïcödé")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.add([t]) for t in gen) + detok.finish()
    assert text == tok.decode(prompt + gen)[len(tok.decode(prompt)) :]
