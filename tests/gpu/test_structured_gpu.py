"""GPU: structured outputs on CUDA, where a step really is in flight while the next is planned
(overlapped scheduling): a constrained request is planned with its last sample in flight, and
the runner waits for that token after enqueueing the step's forward; the masks travel from
pinned memory without a sync.

Eight sampled requests under one JSON schema beside four greedy chats that keep the loop busy:
every constrained output parses and matches the schema and ends with EOS, the chats run their
48 tokens, and every matcher is released with its request. (The chats' tokens are not compared
with a run without the constrained requests: a different decode batch takes other GEMM tiles,
and a random model's greedy tokens may flip on the last bits.)"""

from __future__ import annotations

import json
import random

import pytest
from gpu_engines import add_greedy, small_engine

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["yes", "no", "maybe"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["label", "n"],
    "additionalProperties": False,
}


def _run(grammar: str) -> tuple[dict[str, list[int]], dict[str, str], int]:
    from runtime.request import Request, RequestKind, SamplingParams

    eng, sink = small_engine()
    rng = random.Random(5)
    try:
        eng.start()
        for i in range(4):
            add_greedy(eng, rng, f"chat{i}", 200 + 50 * i, 48)
        ids = [f"chat{i}" for i in range(4)]
        for i in range(8):
            prompt = [rng.randrange(100, 30_000) for _ in range(64)]
            sp = SamplingParams(max_tokens=64, temperature=1.0, seed=i, grammar=grammar)
            eng.add(Request(f"json{i}", RequestKind.GENERATE, prompt, sp))
            ids.append(f"json{i}")
        assert sink.wait(ids, 300)
        texts = {
            r: eng.tokenizer.decode(sink.tokens.get(r, []), skip_special_tokens=True)
            for r in ids
            if r.startswith("json")
        }
        for r in ids:
            if r.startswith("json"):
                assert sink.done[r].finish_reason == "stop", (r, texts[r])
                assert sink.tokens[r][-1] in eng.model_config.eos_token_ids
        chats = {r: sink.tokens[r] for r in ids if r.startswith("chat")}
        return chats, texts, len(eng.runner.grammars)
    finally:
        eng.shutdown(0)


def test_schema_outputs_beside_busy_chats_on_cuda() -> None:
    from runtime.sampling.structured import compile_response_format

    grammar = compile_response_format(
        {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    )
    chats, texts, live_matchers = _run(grammar)
    assert len(texts) == 8
    for text in texts.values():
        value = json.loads(text)
        assert value["label"] in ("yes", "no", "maybe") and 0 <= value["n"] <= 99
    assert all(len(tokens) == 48 for tokens in chats.values())
    assert live_matchers == 0
