"""The front end's output processor: token ids from the engine core -> `RequestOutput`s with text.

Per GENERATE request it keeps an incremental detokenizer and applies stop strings: text that
could be the beginning of a stop string is held back until it cannot; on a match the text is
cut before the stop string, the request is finished with "stop", and `process` says so, so the
caller aborts the request in the engine (which may already have computed a token or two more:
those are dropped here). A stop token's (or EOS's) own text is shown only with
`include_stop_str_in_output` (vLLM's rule; a special token's text also needs
`skip_special_tokens` false). SCORE outputs pass through unchanged. Runs on the API server's
event loop; nothing here touches the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.request import EngineOutput, Request, RequestKind, RequestOutput
from runtime.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class _State:
    prompt_tail: list[int]
    stop: list[str]
    detok: IncrementalDetokenizer | None = None
    text: str = ""  # generated text so far, including held-back text
    num_sent_chars: int = 0  # prefix of `text` already sent
    max_stop_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop: bool = False  # include_stop_str_in_output (a stop string's, a stop token's)
    min_tokens: int = 0  # stop strings end the text only once more output tokens are out
    num_tokens: int = 0  # output tokens seen


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        """tokenizer: anything with `decode(ids, skip_special_tokens=True) -> str`."""
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add(self, req: Request) -> None:
        """Track a GENERATE request about to be sent to the engine (SCORE needs nothing)."""
        if req.kind != RequestKind.GENERATE:
            return
        sp = req.sampling
        stop = [s for s in sp.stop if s]
        self._states[req.request_id] = _State(
            # A few prompt tokens give the detokenizer its joining context.
            prompt_tail=req.prompt_token_ids[-8:],
            stop=stop,
            max_stop_len=max((len(s) for s in stop), default=0),
            skip_special_tokens=sp.skip_special_tokens,
            include_stop=sp.include_stop_str_in_output,
            min_tokens=sp.min_tokens,
        )

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._states)

    def process(self, out: EngineOutput) -> tuple[RequestOutput, bool]:
        """(the output for the route; True when a stop string finished the request here:
        abort it in the engine). Outputs of a request this processor already finished come
        back without text (the caller has stopped listening to it)."""
        st = self._states.get(out.request_id)
        if st is None:  # SCORE (no text), or a late output of a request finished here
            return _plain(out, ""), False
        stopped_by_string = False
        tokens = out.new_token_ids
        st.num_tokens += len(tokens)
        # The engine finishes with "stop" only on a stop token / EOS: its text is hidden unless
        # include_stop_str_in_output asks for it.
        stop_token = out.finished and out.finish_reason == "stop" and bool(tokens)
        visible = tokens[:-1] if stop_token and not st.include_stop else tokens
        detok = st.detok
        if detok is None and (visible or out.finished):
            detok = st.detok = IncrementalDetokenizer(
                self.tokenizer,  # type: ignore[arg-type]
                st.prompt_tail,
                skip_special_tokens=st.skip_special_tokens,
            )
        if visible:
            st.text += detok.add(list(visible))  # type: ignore[union-attr]
        finished = out.finished
        if finished and detok is not None:
            st.text += detok.finish()
        finish_reason = out.finish_reason
        visible_end = len(st.text)
        if st.stop and st.num_tokens > st.min_tokens:  # (vLLM's rule)
            start = max(0, st.num_sent_chars - st.max_stop_len)
            hit = _find_stop(st.text, st.stop, start)
            if hit is not None:
                visible_end = hit[0] + (len(hit[1]) if st.include_stop else 0)
                if not finished:
                    stopped_by_string = True
                finished = True
                finish_reason = "stop"
            elif not finished:
                visible_end = len(st.text) - _held_back(st.text, st.stop)
        visible_end = max(visible_end, st.num_sent_chars)
        new_text = st.text[st.num_sent_chars : visible_end]
        st.num_sent_chars = visible_end
        result = _plain(out, new_text)
        if finished:
            self._states.pop(out.request_id, None)
            result.finished = True
            result.finish_reason = finish_reason
        return result, stopped_by_string


def _plain(out: EngineOutput, new_text: str) -> RequestOutput:
    return RequestOutput(
        request_id=out.request_id,
        new_token_ids=list(out.new_token_ids),
        new_text=new_text,
        new_logprobs=list(out.new_logprobs),
        label_probs=out.label_probs,
        finished=out.finished,
        finish_reason=out.finish_reason,
        error=out.error,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        num_output_tokens=out.num_output_tokens,
        prompt_logprobs=out.prompt_logprobs,
        queue_s=out.queue_s,
        ttft_s=out.ttft_s,
        e2e_s=out.e2e_s,
        prefill_s=out.prefill_s,
        decode_s=out.decode_s,
    )


def _find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """(index, stop string) of the earliest occurrence of any stop string at or after
    `start` (the longest of those starting there)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that could begin a stop string (not sent yet)."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held
