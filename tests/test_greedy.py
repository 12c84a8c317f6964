"""Issue 2 test 9b: greedy generation through the engine (paged KV, prefix cache on, requests
batched together) equals transformers' greedy `generate`, token for token, for 32 tokens."""

from __future__ import annotations

import threading

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.request import EngineOutput, Request, RequestKind, SamplingParams

NUM_TOKENS = 32
SYSTEM = "You are a helpful assistant who answers briefly and precisely. " * 3


def _prompts(tok) -> list[list[int]]:
    # Two chats share a long system prompt (prefix-cache hits for the later ones).
    chats = [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Name three primary colours."},
        ],
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12 times 7?"}],
        [{"role": "user", "content": "Write one sentence about the sea."}],
    ]
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True)) for c in chats]


def _hf_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # exactly NUM_TOKENS tokens, like ignore_eos
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NUM_TOKENS,
                min_new_tokens=0,
                pad_token_id=0,
                eos_token_id=None,
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def test_greedy_matches_transformers(default_model_dir) -> None:
    outs: dict[str, list[EngineOutput]] = {}
    cv = threading.Condition()

    def sink(step_outs: list[EngineOutput]) -> None:  # one engine step's outputs
        with cv:
            for o in step_outs:
                outs.setdefault(o.request_id, []).append(o)
            cv.notify_all()

    cfg = EngineConfig(
        model=str(default_model_dir),
        dtype="float32",
        device="cpu",
        prefill_policy="fcfs",
        block_size=16,
        enable_prefix_cache=True,
    )
    engine = Engine(cfg, sink)
    engine.start()
    try:
        prompts = _prompts(engine.tokenizer)
        sp = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)

        def finished(rid: str) -> bool:
            return bool(outs.get(rid)) and outs[rid][-1].finished

        # First alone (fills the cache), then the other two together (a prefix hit, batched
        # decode with different context lengths).
        engine.add(Request("p0", RequestKind.GENERATE, prompts[0], sp))
        with cv:
            assert cv.wait_for(lambda: finished("p0"), timeout=120)
        engine.add(Request("p1", RequestKind.GENERATE, prompts[1], sp))
        engine.add(Request("p2", RequestKind.GENERATE, prompts[2], sp))
        with cv:
            assert cv.wait_for(lambda: finished("p1") and finished("p2"), timeout=120)
        stats = engine.stats()
    finally:
        engine.shutdown(0)

    ours = [[t for o in outs[f"p{i}"] for t in o.new_token_ids] for i in range(3)]
    assert all(o[-1].error is None for o in outs.values())
    assert outs["p1"][-1].num_cached_tokens > 0  # the shared system prompt came from the cache
    assert stats["prefix_hit_tokens"] > 0
    ref = _hf_greedy(default_model_dir, prompts)
    for i in range(3):
        assert ours[i] == ref[i], f"prompt {i}: ours {ours[i]} vs transformers {ref[i]}"
