"""The front end's output processor: token ids from the engine -> text deltas, with stop strings
held back and cut, a stop token's text hidden, surplus outputs after a stop-string finish
dropped, scoring outputs passed through."""

from __future__ import annotations

from runtime.core.output_processor import OutputProcessor
from runtime.request import EngineOutput, Request, RequestKind, SamplingParams

EOS = 99


class CharTokenizer:
    """Token id t decodes to chr(ord('a') + t % 26); EOS decodes to nothing (special)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if t == EOS else chr(ord("a") + t % 26) for t in ids)


def gen(rid: str, **sp) -> Request:
    return Request(rid, RequestKind.GENERATE, [1, 2, 3], SamplingParams(max_tokens=10, **sp))


def feed(proc: OutputProcessor, rid: str, tokens: list[int], last_reason: str | None = None):
    outs = []
    for i, t in enumerate(tokens):
        finished = last_reason is not None and i == len(tokens) - 1
        eo = EngineOutput(
            rid,
            new_token_ids=[t],
            finished=finished,
            finish_reason=last_reason if finished else None,
        )
        outs.append(proc.process(eo))
    return outs


def test_text_deltas_and_a_hidden_stop_token() -> None:
    proc = OutputProcessor(CharTokenizer())
    proc.add(gen("a"))
    outs = feed(proc, "a", [2, 3, 7], last_reason="stop")  # 7: a stop token id
    assert [o.new_text for o, _ in outs] == ["c", "d", ""]
    assert outs[-1][0].finished and outs[-1][0].finish_reason == "stop"
    assert not any(stopped for _, stopped in outs)  # the engine finished it: nothing to abort


def test_stop_string_is_cut_held_back_and_tells_the_caller_to_abort() -> None:
    proc = OutputProcessor(CharTokenizer())
    proc.add(gen("a", stop=["ef", "xyz"]))
    # tokens 2,3,4,5,6 -> "c d e f g"; stop "ef" appears after "cd"; "e" alone is held back.
    outs = feed(proc, "a", [2, 3, 4, 5])
    texts = [o.new_text for o, _ in outs]
    assert "".join(texts) == "cd" and texts[2] == ""
    last, stopped = outs[-1]
    assert last.finished and last.finish_reason == "stop" and stopped
    assert proc.num_tracked == 0
    # The engine's surplus output for it arrives later: no text, nothing more to do.
    late, stopped = proc.process(EngineOutput("a", new_token_ids=[6]))
    assert late.new_text == "" and not stopped


def test_length_finish_flushes_held_back_text() -> None:
    proc = OutputProcessor(CharTokenizer())
    proc.add(gen("a", stop=["ef"]))
    outs = feed(proc, "a", [2, 4], last_reason="length")  # "c", "e": "e" could start "ef"
    assert [o.new_text for o, _ in outs] == ["c", "e"]  # flushed at the finish


def test_scoring_outputs_pass_through() -> None:
    proc = OutputProcessor(CharTokenizer())
    proc.add(Request("s", RequestKind.SCORE, [1, 2], label_token_ids=[1, 2]))
    out, stopped = proc.process(
        EngineOutput("s", label_probs=[0.25, 0.75], finished=True, finish_reason="stop")
    )
    assert out.label_probs == [0.25, 0.75] and out.new_text == "" and not stopped


class SpecialTokenizer(CharTokenizer):
    """CharTokenizer with token 50 a special token whose text is "<sp>"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        plain = CharTokenizer().decode
        return "".join(
            ("" if skip_special_tokens else "<sp>") if t == 50 else plain([t]) for t in ids
        )


def test_skip_special_tokens_false_shows_their_text() -> None:
    proc = OutputProcessor(SpecialTokenizer())
    proc.add(gen("hidden"))
    proc.add(gen("shown", skip_special_tokens=False))
    hidden = feed(proc, "hidden", [2, 50, 3], last_reason="length")
    shown = feed(proc, "shown", [2, 50, 3], last_reason="length")
    assert "".join(o.new_text for o, _ in hidden) == "cd"
    assert "".join(o.new_text for o, _ in shown) == "c<sp>d"


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    proc = OutputProcessor(CharTokenizer())
    proc.add(gen("a", stop=["ef"], include_stop_str_in_output=True))
    outs = feed(proc, "a", [2, 3, 4, 5])  # "cdef": "e" held back, then the stop with it
    assert "".join(o.new_text for o, _ in outs) == "cdef" and outs[2][0].new_text == ""
    last, stopped = outs[-1]
    assert last.finished and last.finish_reason == "stop" and stopped


def test_min_tokens_keeps_stop_strings_from_ending_the_text_early() -> None:
    proc = OutputProcessor(CharTokenizer())
    proc.add(gen("a", stop=["d"], min_tokens=3))
    outs = feed(proc, "a", [2, 3, 4, 3])  # "cded": the first "d" is token 2 of min 3
    assert "".join(o.new_text for o, _ in outs) == "cde"
    assert outs[-1][0].finished and outs[-1][1]
