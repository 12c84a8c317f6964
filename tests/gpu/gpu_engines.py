"""Shared by the GPU tests that compare engine configurations: a small random:qwen2.5-3b engine
on FlashInfer (head_dim 128, whose kernels the device runs have cached), one mixed workload
(chat streams beside scoring requests that share a profile) run to its end, and the relative
error the comparisons use."""

from __future__ import annotations

import random
from typing import Any

import pytest


def small_engine(**kw: Any) -> tuple[Any, Any]:
    """(engine, sink) of random:qwen2.5-3b with a 1,200-block pool; `kw` overrides the config.
    Skips the test without CUDA."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from bench.gpu_partition import Sink
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    sink = Sink()
    defaults: dict[str, Any] = {
        "model": "random:qwen2.5-3b",
        "attention_backend": "flashinfer",
        "cuda_graphs": True,
        "num_kv_blocks": 1200,
        "max_num_seqs": 16,
        "max_model_len": 4096,
        "prefill_policy": "fcfs",
    }
    cfg = EngineConfig(**{**defaults, **kw})
    return Engine(cfg, sink), sink


def add_greedy(
    eng: Any, rng: random.Random, rid: str, num_prompt_tokens: int, max_tokens: int
) -> None:
    """Add a greedy chat request of random token ids that decodes all `max_tokens` (no EOS)."""
    from runtime.request import Request, RequestKind, SamplingParams

    ids = [rng.randrange(100, 30_000) for _ in range(num_prompt_tokens)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    eng.add(Request(rid, RequestKind.GENERATE, ids, sampling=params))


def rel_err(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


def chat_and_scoring(
    seed: int,
    profile_tokens: int,
    num_items: int,
    item_max: int,
    chat_max: int,
    max_tokens: int,
) -> list[Any]:
    """Four greedy chat requests of 30..chat_max prompt tokens (`max_tokens` each, EOS ignored),
    then `num_items` scoring requests: one shared profile plus an item of 20..item_max tokens."""
    from runtime.request import Request, RequestKind, SamplingParams

    rng = random.Random(seed)
    profile = [rng.randrange(5, 30000) for _ in range(profile_tokens)]
    items = [
        [rng.randrange(5, 30000) for _ in range(rng.randrange(20, item_max))]
        for _ in range(num_items)
    ]
    chats = [
        [rng.randrange(5, 30000) for _ in range(rng.randrange(30, chat_max))] for _ in range(4)
    ]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    reqs = [Request(f"chat{i}", RequestKind.GENERATE, c, sp) for i, c in enumerate(chats)]
    reqs += [
        Request(f"s{i}", RequestKind.SCORE, profile + it, label_token_ids=[11, 22, 33])
        for i, it in enumerate(items)
    ]
    return reqs


def run_to_end(eng: Any, sink: Any, reqs: list[Any]) -> dict[str, tuple[Any, list[int]]]:
    """Start the engine, run `reqs` to their end, shut it down: request id -> (final output,
    generated token ids)."""
    eng.start()
    try:
        for r in reqs:
            eng.add(r)
        assert sink.wait([r.request_id for r in reqs], timeout_s=120)
        return {
            r.request_id: (sink.done[r.request_id], sink.tokens.get(r.request_id, [])) for r in reqs
        }
    finally:
        eng.shutdown(0)


def greedy_agreement(base: dict[str, list[int]], other: dict[str, list[int]]) -> tuple[int, int]:
    """(tokens that agree up to each stream's first difference, all tokens) over the streams
    of `base`. bf16: a near tie may flip one greedy pick, and the stream diverges from there."""
    agree = total = 0
    for rid, tokens in base.items():
        pairs = zip(tokens, other[rid], strict=True)
        agree += next((i for i, (a, b) in enumerate(pairs) if a != b), len(tokens))
        total += len(tokens)
    return agree, total
