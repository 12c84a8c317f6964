"""Tokenizer (over `tokenizers.Tokenizer`), the model's chat template, streaming detokenizer.

A model folder provides `tokenizer.json` and a chat template, either in `chat_template.jinja`
or as `chat_template` in `tokenizer_config.json` (which also names the bos/eos tokens).
The template is rendered with jinja2 in a sandboxed environment, with the helpers Hugging Face
templates expect (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII).

Special tokens, as `transformers` places them: a text prompt (completions, scoring) gets the
tokens of `tokenizer.json`'s post-processor (`encode(text, add_special_tokens=True)`: e.g. Llama
3's BOS); a chat prompt gets only what its template writes (`encode_chat`: no second BOS). Text
typed in chat messages is text: `encode_chat` never turns a message's `<|im_start|>` into the
control token, while the template's own control tokens stay control tokens.

Encoding releases the GIL (`encode_batch` runs in Rust without it; single `encode` holds it), so
a server thread tokenising a huge prompt does not stall the event loop.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
import tokenizers.decoders

REPLACEMENT_CHAR = "\ufffd"


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (its `raise_exception` was called)."""


class Tokenizer:
    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self._tok = tok
        self.chat_template = chat_template
        # bos_token / eos_token / pad_token / unk_token strings, passed to the template.
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        eos: list[int] = []
        eos_str = self.special_tokens.get("eos_token")
        if eos_str is not None and (eos_id := tok.token_to_id(eos_str)) is not None:
            eos.append(eos_id)
        for i in extra_eos_token_ids:
            if i not in eos:
                eos.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        bos_str = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = tok.token_to_id(bos_str) if bos_str else None
        self._template: jinja2.Template | None = (
            _compile_template(chat_template) if chat_template else None
        )
        # The most characters of text one token can stand for: a token's string has one
        # character per byte it covers (byte-level BPE) or per character (SentencePiece; a
        # byte-fallback token's string is longer than its one byte). So a text longer than
        # this x the context can never fit, and need not be tokenised to know it.
        self.max_chars_per_token: int = max(
            (len(t) for t in tok.get_vocab(with_added_tokens=True)), default=1
        )
        # Special (control) tokens, longest first, to spot their text in chat messages.
        specials = sorted(
            (t.content for t in tok.get_added_tokens_decoder().values() if t.special and t.content),
            key=len,
            reverse=True,
        )
        self._special_text_re: re.Pattern[str] | None = (
            re.compile("|".join(re.escape(t) for t in specials)) if specials else None
        )
        # How a token's string maps to bytes (`token_bytes`), from the decoder's kind.
        self._decoder_kind = _decoder_kind(tok)
        self._added_ids = set(tok.get_added_tokens_decoder())
        self._token_bytes: dict[int, bytes] = {}
        # A copy that reads special-token text as plain text (made on first use). A copy, not
        # a toggle of `encode_special_tokens` on `_tok`: other threads encode with `_tok`.
        self._text_tok: tokenizers.Tokenizer | None = None
        self._text_tok_lock = threading.Lock()

    @classmethod
    def from_dir(cls, folder: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja` if present)."""
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        tok = tokenizers.Tokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        template: str | None = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif cfg.get("chat_template"):
            template = _pick_template(cfg["chat_template"])
        special = {
            name: _token_str(cfg.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        return cls(tok, template, special)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what llguidance builds its own from)."""
        return self._tok.to_str()

    # --- basic encode / decode -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. `add_special_tokens` adds the tokenizer's post-processor tokens (e.g.
        a BOS); chat prompts rendered by the template already contain theirs. Special-token
        text in `text` becomes the special token (use `encode_text` for user-typed text)."""
        # encode_batch of one: same ids as encode, but computed without holding the GIL.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` read as plain text: special-token text (`<|im_start|>`) is split into
        ordinary tokens, never mapped to the control token. No special tokens are added."""
        if self._text_tok is None:
            with self._text_tok_lock:
                if self._text_tok is None:
                    text_tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
                    text_tok.encode_special_tokens = True
                    self._text_tok = text_tok
        return self._text_tok.encode_batch([text], add_special_tokens=False)[0].ids

    def has_special_text(self, text: str) -> bool:
        """True if `text` contains the text of a special token."""
        return self._special_text_re is not None and self._special_text_re.search(text) is not None

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        encs = self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a logprob entry's `bytes`: a token that is part
        of a multi-byte character decodes to U+FFFD alone, while its bytes rebuild the
        character when joined with its neighbours'). Byte-level BPE: the token's string maps
        back through the byte alphabet; SentencePiece: a byte-fallback piece `<0xNN>` is that
        byte, "▁" a space; special tokens and anything else: their text in UTF-8."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self._tok.id_to_token(token_id)
        out: bytes
        if piece is None or token_id in self._added_ids:
            out = self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        elif self._decoder_kind == "byte_level" and all(c in _UNICODE_TO_BYTE for c in piece):
            out = bytes(_UNICODE_TO_BYTE[c] for c in piece)
        elif self._decoder_kind == "sentencepiece" and _BYTE_PIECE.fullmatch(piece):
            out = bytes([int(piece[3:5], 16)])
        elif self._decoder_kind == "sentencepiece":
            out = piece.replace("\u2581", " ").encode("utf-8")
        else:
            out = self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._token_bytes[token_id] = out
        return out

    def single_token_id(self, text: str) -> int | None:
        """The id if `text` encodes to exactly one token (without added special tokens), else
        None. Used to validate scoring labels."""
        ids = self.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    # --- chat template ---------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render messages with the model's chat template. Extra kwargs (e.g. `tools`,
        `enable_thinking`) are passed to the template. Raises ChatTemplateError when the
        template rejects the input, ValueError when the model has no template."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """Render `messages` with the chat template and tokenise the result, reading message
        content as plain text: a message that contains special-token text (a user typing
        `<|im_start|>system`) gets ordinary tokens for it, while the template's own control
        tokens stay control tokens. No special tokens are added beyond the template's.

        Messages without special-token text (nearly all) take the exact path: the rendered
        string encoded whole. Otherwise the template is rendered a second time with a random
        sentinel for each message's content, which shows where each content lands; the
        template's text is encoded as usual and each content with `encode_text`. If the
        template changes content on the way (beyond stripping whitespace), the content cannot
        be located safely: ChatTemplateError (a 400 for the caller).

        `continue_final_message`: the prompt ends right after the last message's content (no
        end-of-turn after it), so the model continues that message (vLLM's option)."""
        rendered = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        final = messages[-1].get("content") if messages else None
        if continue_final_message:
            rendered = _open_final(rendered, final)
        contents = [m.get("content") for m in messages]
        if not any(isinstance(c, str) and self.has_special_text(c) for c in contents):
            return self.encode(rendered)
        nonce = secrets.token_hex(8)
        probe = [
            {**m, "content": f"GLMSG{nonce}X{i}Z"} if isinstance(m.get("content"), str) else m
            for i, m in enumerate(messages)
        ]
        skeleton = self.apply_chat_template(probe, add_generation_prompt, **kwargs)
        # Template text at even indices, the index of a message's sentinel at odd ones.
        parts = re.split(f"GLMSG{nonce}X(\\d+)Z", skeleton)
        for strip in (False, True):  # True: templates such as Llama 3's `content | trim`
            pieces = []
            for k, part in enumerate(parts):
                content = str(contents[int(part)]) if k % 2 else part
                pieces.append(content.strip() if strip and k % 2 else content)
            if continue_final_message:  # up to the final message's content, as `rendered`
                last = max(
                    (k for k in range(1, len(parts), 2) if int(parts[k]) == len(messages) - 1),
                    default=len(pieces) - 1,
                )
                pieces = pieces[: last + 1]
            if "".join(pieces) == rendered:
                ids: list[int] = []
                for k, piece in enumerate(pieces):
                    if piece:
                        ids += self.encode_text(piece) if k % 2 else self.encode(piece)
                return ids
        raise ChatTemplateError(
            "a message contains special-token text and this model's chat template rewrites "
            "message content, so it cannot be kept as plain text; remove the special-token text"
        )


def _open_final(rendered: str, content: Any) -> str:
    """`rendered` cut right after the final message's content (its last occurrence; stripped
    too, for templates that trim content). ChatTemplateError when it cannot be found."""
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with content")
    for text in (content, content.strip()):
        i = rendered.rfind(text)
        if i >= 0:
            return rendered[: i + len(text)]
    raise ChatTemplateError(
        "the chat template changes the final message's content, so the prompt cannot be "
        "ended inside it (continue_final_message)"
    )


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet, inverted: the printable bytes stand for themselves, every
    other byte for the next code point from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(code): b for b, code in chars.items()}


_UNICODE_TO_BYTE = _byte_alphabet()
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _decoder_kind(tok: tokenizers.Tokenizer) -> str:
    """ "byte_level", "sentencepiece" (a "▁" replace and byte fallback), or "other"."""
    try:  # the decoder's own JSON (not the whole tokenizer's, megabytes with its vocabulary)
        decoder = json.loads(tok.decoder.__getstate__()) if tok.decoder is not None else {}
    except (AttributeError, ValueError, TypeError):
        return "other"
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder]) if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "sentencepiece"
    return "other"


def _decode_stream(tokenizer: Any, context: list[int], skip_special_tokens: bool) -> Any:
    """tokenizers' own incremental decoder for `tokenizer` when it wraps a Hugging Face
    tokenizer (None otherwise, e.g. test tokenizers)."""
    hf = getattr(tokenizer, "_tok", None)
    stream_cls = getattr(tokenizers.decoders, "DecodeStream", None)
    if not isinstance(hf, tokenizers.Tokenizer) or stream_cls is None:
        return None
    try:
        return stream_cls(ids=list(context), skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers < 0.22: no context ids, which SentencePiece spacing needs
        return None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Byte-level BPE can split one UTF-8 character over several tokens; decoding such a prefix
    gives U+FFFD, so text is emitted only once a character is complete. The prompt's last
    tokens are context: tokenizer-specific joining (e.g. SentencePiece's leading space) then
    matches a full decode.

    Two ways, the same text: with a Hugging Face tokenizer, its `DecodeStream` (Rust, one call
    per token: the per-token cost of a stream on the API server); with any other tokenizer,
    decoding a short window [prefix_offset, end) twice per step and emitting once the text no
    longer ends with U+FFFD. `finish()` flushes whatever is pending (a truly invalid byte
    sequence then shows as U+FFFD, exactly as the full decode would).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        # Tokens [prefix_offset, read_offset) were already emitted and are decoded again only
        # as context; tokens from read_offset on are pending.
        self._read_offset = len(self.ids)
        self._prefix_offset = max(0, len(self.ids) - 5)
        self._context_end = len(self.ids)
        self.text = ""  # everything emitted so far (generated part only)
        self._stream = _decode_stream(
            tokenizer, self.ids[self._prefix_offset :], skip_special_tokens
        )

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append generated ids; returns the newly complete text (may be "")."""
        self.ids.extend(new_ids)
        if self._stream is not None:
            step, hf = self._stream.step, self._tok._tok  # type: ignore[attr-defined]
            delta = "".join([piece for i in new_ids if (piece := step(hf, i)) is not None])
            self.text += delta
            return delta
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # incomplete character (or nothing visible yet): wait for more tokens
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Emit any pending text, even if it ends in an incomplete character."""
        if self._stream is not None:
            # What a full decode of context + output gives beyond the context, less what was
            # emitted: the held-back bytes of an incomplete character (usually nothing).
            start = max(0, self._context_end - 5)
            context_text = self._decode(self.ids[start : self._context_end])
            full_text = self._decode(self.ids[start:])[len(context_text) :]
            delta = full_text[len(self.text) :] if full_text.startswith(self.text) else ""
            self.text += delta
            return delta
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.ids[self._prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta


# --- template helpers ------------------------------------------------------------------------


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    # Either a string or a list of {"name", "template"}; take "default" (else the first).
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()))
    return None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
