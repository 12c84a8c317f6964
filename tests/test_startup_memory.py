"""bench.startup_memory reads what a server's start-up log says about memory."""

from __future__ import annotations

import argparse
import logging

import pytest

from bench.startup_memory import parse_side, read_startup_log
from runtime.config import EngineConfig
from runtime.engine import Engine

GPU_LOG = """\
2026-12-06 06:20:19,187 INFO greenlane.engine: model random:llama-3.1-8b loaded in 6.3 s (cuda, bfloat16)
2026-12-06 06:20:19,300 INFO greenlane.engine: hybrid prefill's chunk: 16384 tokens (auto: the largest of 16384/8192/4096/2048 whose MLP temporaries take at most 5 % of the 55.1 GiB the KV pool and activations share, else the smallest; 1.56 GiB, 2.8 %; --prefill-chunk-tokens sets it)
2026-12-06 06:20:31,000 INFO greenlane.engine: activation peak measured in 11.2 s: 0.93 GiB at 8192 tokens, 11.5 KiB/token; reserving 3.10 GiB (scoring prompts up to 131072 tokens)
2026-12-06 06:20:31,100 INFO greenlane.engine: KV cache: 25000 blocks of 16 tokens, 400000 tokens, 48.83 GiB (sized from memory)
2026-12-06 06:20:40,190 INFO greenlane.app: engine ready: max_model_len=131072
2026-12-06 06:20:41,000 INFO greenlane.request: id=x status=200
"""


def test_the_memory_lines_and_their_numbers() -> None:
    got = read_startup_log(GPU_LOG)
    assert len(got["lines"]) == 4  # not the model load or the request line
    assert (got["auto_chunk_tokens"], got["kv_blocks"], got["kv_tokens"]) == (16384, 25000, 400000)
    assert (got["kv_gib"], got["activation_reserve_gib"], got["max_score_tokens"]) == (
        48.83,
        3.10,
        131072,
    )
    # A chunk given on the command line logs no auto line: None, not a guess.
    assert (
        read_startup_log(GPU_LOG.replace("hybrid prefill's chunk", "x"))["auto_chunk_tokens"]
        is None
    )


def test_the_engines_own_kv_line_parses(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="greenlane.engine"):
        engine = Engine(EngineConfig(model="random:tiny", device="cpu"), lambda outs: None)
    try:
        got = read_startup_log(caplog.text)
        assert got["kv_blocks"] == engine.block_manager.num_blocks
        assert got["kv_tokens"] == 16 * engine.block_manager.num_blocks
    finally:
        engine.shutdown()


def test_sides_are_name_and_options() -> None:
    assert parse_side("c2k=--prefill-chunk-tokens 2048") == (
        "c2k",
        ["--prefill-chunk-tokens", "2048"],
    )
    assert parse_side("auto=") == ("auto", [])
    with pytest.raises(argparse.ArgumentTypeError):
        parse_side("--prefill-chunk-tokens 2048")
