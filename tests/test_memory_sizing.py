"""KV-pool sizing on CUDA, with the device's memory reported by stand-ins (no GPU needed).

Found on the H200: an engine started in a process that had run other models refused to start
("no room for the KV cache"), because memory the caching allocator kept cached counted as used,
and because a default `max_score_tokens` = max_model_len reserved activations for a prompt
longer than the GPU could ever hold beside its KV cache."""

from __future__ import annotations

import types

import pytest
import torch

from runtime.config import PREFILL_CHUNK_TOKENS_UNSIZED, EngineConfig
from runtime.engine import Engine
from runtime.kv.kv_pool import (
    CHUNK_MEMORY_SHARE,
    PREFILL_CHUNK_CHOICES,
    auto_prefill_chunk_tokens,
    bytes_per_block,
    chunk_temporaries_bytes,
    compute_num_blocks,
    cuda_memory_budget_bytes,
)
from runtime.model.presets import get_preset
from runtime.runner import ActivationLine
from runtime.startup import MemorySizing, size_prefill_chunk

GIB = 1 << 30


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    """A 100 GiB device; `state['cached']` bytes are freed by empty_cache()."""
    state = {"total": 100 * GIB, "used": 40 * GIB, "cached": 0, "reserved": 10 * GIB}
    calls: list[str] = []

    def empty_cache() -> None:
        calls.append("empty_cache")
        state["used"] -= state["cached"]
        state["cached"] = 0

    def mem_get_info(*_a):
        calls.append("mem_get_info")
        return state["total"] - state["used"], state["total"]

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *_a: state["reserved"])
    return state, calls


def test_budget_releases_cached_memory_first_and_applies_both_limits(fake_gpu) -> None:
    state, calls = fake_gpu
    state["cached"] = 20 * GIB  # of the 40 GiB in use, 20 are only cached by this process
    cfg = EngineConfig(model="random:tiny", gpu_memory_utilization=0.9)
    # 90 % of 100 GiB minus the 20 GiB really in use.
    assert cuda_memory_budget_bytes(cfg, torch.device("cuda")) == pytest.approx(70 * GIB)
    assert calls[:2] == ["empty_cache", "mem_get_info"]
    capped = EngineConfig(model="random:tiny", gpu_memory_utilization=0.9, max_gpu_memory_gb=30)
    # The cap: 30 GiB minus the 10 GiB this process holds.
    assert cuda_memory_budget_bytes(capped, torch.device("cuda")) == pytest.approx(20 * GIB)
    # ... of which 6 GiB were held before this engine started (another engine in the same
    # process): the cap applies to this engine's own 4 GiB.
    assert cuda_memory_budget_bytes(
        capped, torch.device("cuda"), baseline_reserved=6 * GIB
    ) == pytest.approx(26 * GIB)


def test_num_blocks_is_budget_minus_reserve_over_block_bytes(fake_gpu) -> None:
    cfg = EngineConfig(model="random:tiny", gpu_memory_utilization=0.9)
    mc = get_preset("tiny")
    per_block = bytes_per_block(mc, cfg.block_size, torch.bfloat16)
    act = 2 * GIB
    n = compute_num_blocks(cfg, mc, torch.bfloat16, torch.device("cuda"), activation_bytes=act)
    budget = 50 * GIB - act - (512 << 20)  # 90 - 40 in use, minus the reserve and the margin
    assert n == int(budget // per_block) - 1  # one block is the pad block


def _sizing(max_model_len: int, max_score_tokens: int) -> MemorySizing:
    return MemorySizing(
        config=EngineConfig(model="random:tiny", gpu_memory_utilization=0.9),
        model_config=get_preset("tiny"),
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        reserved_at_start=0,
        max_model_len=max_model_len,
        max_score_tokens=max_score_tokens,
    )


def test_default_max_score_tokens_is_lowered_to_what_fits(fake_gpu, caplog) -> None:
    # 50 GiB of budget; 1 MiB of activations per prompt token: a 1M-token prompt cannot fit.
    stub = _sizing(max_model_len=1 << 20, max_score_tokens=1 << 20)
    slope, fixed = float(1 << 20), float(GIB)
    stub.fit_max_score_tokens(ActivationLine(8192, fixed + slope * 8192, 8192, slope, fixed))
    got = stub.max_score_tokens
    assert 8192 <= got < 1 << 20 and got % 16 == 0
    # What is left beside the reserve still holds one max_model_len sequence.
    per_block = bytes_per_block(stub.model_config, 16, torch.bfloat16)
    left = 50 * GIB - (fixed + slope * got) - (512 << 20)
    assert left >= ((1 << 20) // 16 + 1) * per_block
    assert "scoring prompts limited to" in caplog.text


def test_max_score_tokens_is_kept_when_it_fits(fake_gpu) -> None:
    stub = _sizing(max_model_len=32768, max_score_tokens=32768)
    # ~0.3 GiB for 32k tokens: fits easily
    line = ActivationLine(8192, GIB + 10_000.0 * 8192, 8192, 10_000.0, float(GIB))
    stub.fit_max_score_tokens(line)
    assert stub.max_score_tokens == 32768


def test_never_below_one_step_budget(fake_gpu) -> None:
    state, _ = fake_gpu
    state["used"] = 89 * GIB  # almost nothing left
    stub = _sizing(max_model_len=32768, max_score_tokens=32768)
    slope = float(1 << 20)
    stub.fit_max_score_tokens(ActivationLine(8192, GIB + slope * 8192, 8192, slope, float(GIB)))
    assert stub.max_score_tokens == 8192


def test_a_cap_below_one_max_model_len_sequence_gives_scoring_the_room(fake_gpu, caplog) -> None:
    # max_model_len's KV (2**27 tokens x 512 B = 64 GiB) exceeds the whole 50 GiB budget: no
    # reserve leaves room for it, so generation is limited by the pool whatever is reserved.
    # Found on the H200 (8B, --max-model-len 262144 in 24 GB): the rule "the pool holds one
    # max_model_len sequence" then floored scoring prompts to one step's budget (8192 tokens).
    stub = _sizing(max_model_len=1 << 27, max_score_tokens=1 << 27)
    slope, fixed = float(1 << 20), float(GIB)
    stub.fit_max_score_tokens(ActivationLine(8192, fixed + slope * 8192, 8192, slope, fixed))
    got = stub.max_score_tokens
    room = 50 * GIB - (512 << 20)
    per_block = bytes_per_block(stub.model_config, 16, torch.bfloat16)
    floor_pool = (8192 // 16 + 1) * per_block  # one step's budget of KV, kept for chat
    assert got == int((room - floor_pool - fixed) // slope) // 16 * 16
    assert got > 5 * 8192  # not floored to the step budget
    assert room - (fixed + slope * got) >= floor_pool
    assert "scoring prompts limited to" in caplog.text and "tokens left for it" in caplog.text
    assert "--prefill-token-budget" in caplog.text  # the pool's floor is one step's budget


def test_a_fit_below_the_slopes_first_length_keeps_its_reserve_in_the_room(fake_gpu) -> None:
    """The slope is measured from 16 chunks on (lo = 32,768 here); when fewer tokens fit, the
    fit and the reserve both follow the chord from one step's peak to the peak at lo (the peak
    is convex), so the reserve the engine then keeps is what the fit assumed. Before, the fit
    used the line's extension below lo and the reserve the peak at lo, which could exceed the
    room the fit had found."""
    state, _ = fake_gpu
    slope, fixed = float(1 << 20), float(GIB)
    line = ActivationLine(8192, fixed + slope * 8192, 32768, slope, fixed)
    per_block = bytes_per_block(get_preset("tiny"), 16, torch.bfloat16)
    floor_pool = (8192 // 16 + 1) * per_block  # one step's budget of KV, kept for chat
    room = line.reserve(20000) + floor_pool  # about 20k tokens of scoring fit
    state["used"] = int(90 * GIB - room - (512 << 20))  # budget = 90 % of 100 GiB - used
    stub = _sizing(max_model_len=1 << 27, max_score_tokens=1 << 27)
    stub.fit_max_score_tokens(line)
    got = stub.max_score_tokens
    assert 19_900 < got <= 20000 and got % 16 == 0, got
    assert line.reserve(got) <= room - floor_pool < line.reserve(got + 16)


def test_the_reserve_bounds_a_convex_peak_and_inverts() -> None:
    from runtime.runner import activation_line

    for n0, lo, hi in ((8192, 32768, 65536), (8192, 2048, 4096)):  # lo above / below the step
        line = activation_line(_hybrid_peak, n0, lo, hi)
        assert (line.step_tokens, line.lo) == (n0, lo)
        p0 = line.step_peak
        # (the line holds up to the longest prompt, which the probes never exceed: hi here)
        for n in [*range(16, min(hi, 70000), 512), hi, 200_000 if hi > 8192 else hi]:
            assert line.reserve(n) >= max(_hybrid_peak(n), p0), (lo, n)
        for num_bytes in (p0, p0 + 1e6, max(p0, line.peak_lo), 3 * line.peak_lo, 90 * GIB):
            n = line.longest_within(num_bytes)
            assert n >= n0 and line.reserve(n) <= num_bytes + 1, (lo, num_bytes)
            assert line.reserve(n + 16) > num_bytes, (lo, num_bytes)
        assert line.longest_within(p0 - 1) == 0


def test_no_room_names_the_scoring_reserve_when_it_was_asked_for(fake_gpu) -> None:
    # 50 GiB of budget; a reserve of 60 GiB for an explicit --max-score-tokens leaves nothing.
    mc = get_preset("tiny")
    cfg = EngineConfig(model="random:tiny", gpu_memory_utilization=0.9, max_score_tokens=172032)
    with pytest.raises(RuntimeError, match="--max-score-tokens 172032: lower it"):
        compute_num_blocks(cfg, mc, torch.bfloat16, torch.device("cuda"), activation_bytes=60 * GIB)
    plain = EngineConfig(model="random:tiny", gpu_memory_utilization=0.9)
    with pytest.raises(RuntimeError, match=r"no room for the KV cache.*prefill_token_budget\)$"):
        compute_num_blocks(
            plain, mc, torch.bfloat16, torch.device("cuda"), activation_bytes=60 * GIB
        )


def _hybrid_peak(n: int, chunk: int = 2048) -> int:
    """A hybrid prefill's peak on the 8B shape, as measured: the larger of the attention line
    (28 KiB a token) and the chunked-MLP line (16 KiB a token + C rows of MLP temporaries)."""
    return max(28 * 1024 * n, 16 * 1024 * n + chunk * 88 * 1024)


def test_the_slope_is_measured_where_the_attention_line_leads() -> None:
    """Measured between one step's budget and twice it (8,192 / 16,384 with C = 2,048) the
    slope straddles the crossing of the two lines and comes out ~16 KiB a token, which would
    under-reserve a 200k-token prompt by gigabytes; measured at and above 16 * C it is exact."""
    from runtime.runner import activation_line, activation_probe_lengths

    n0, lo, hi = activation_probe_lengths(8192, 2048, 1 << 18)
    assert (n0, lo, hi) == (8192, 32768, 65536)
    calls: list[int] = []

    def peak_at(n: int) -> int:
        calls.append(n)
        return _hybrid_peak(n)

    line = activation_line(peak_at, n0, lo, hi)
    p0, slope, fixed = line.step_peak, line.slope, line.fixed
    assert calls == [8192, 32768, 65536] and p0 == _hybrid_peak(8192)
    assert (line.step_tokens, line.lo) == (8192, 32768)
    # The engine's reserve for a longest prompt of n tokens covers the peak at any n (the
    # chord between lo and hi, its extension beyond, the peak at lo below it) ...
    for n in [*range(1024, 65536, 1024), 100_000, 200_000]:
        assert max(p0, fixed + slope * max(n, lo)) >= _hybrid_peak(n), n
    # ... and wastes little past lo: at most the chord's rise over the peak at its middle.
    assert max(p0, fixed + slope * 200_000) - _hybrid_peak(200_000) < 64 << 20
    naive = (_hybrid_peak(16384) - _hybrid_peak(8192)) / 8192
    assert naive < 20 * 1024 < slope  # what the old two points measured


def test_probe_lengths_never_exceed_the_longest_prompt() -> None:
    from runtime.runner import activation_probe_lengths

    assert activation_probe_lengths(8192, 2048, 32768) == (8192, 16384, 32768)
    # Scoring limited to 4,096 tokens: a generation step still takes the whole budget.
    assert activation_probe_lengths(8192, 2048, 4096) == (8192, 2048, 4096)
    assert activation_probe_lengths(8192, None, 1 << 20) == (8192, 8192, 16384)  # no chunks
    assert activation_probe_lengths(1, 2048, 1) == (1, 1, 2)  # a 1-token limit still has a line


def test_the_dry_runs_say_they_start_and_how_long_they_took(monkeypatch, caplog) -> None:
    """Start-up's first forwards may JIT-compile the attention kernels for minutes (on a bare
    H200, ~3 min with nothing logged): the engine says before that it is measuring, and after
    how long it took."""
    import runtime.startup as startup_module

    stub = _sizing(max_model_len=32768, max_score_tokens=32768)
    stub.config = EngineConfig(model="random:tiny", cuda_graphs=False, max_score_tokens=32768)
    model = types.SimpleNamespace(rotary=types.SimpleNamespace(max_positions=32768))
    seen: list[str] = []

    def fake_line(peak_at, n0, lo, hi) -> ActivationLine:
        seen.append(caplog.text)  # what was logged before the dry runs
        return ActivationLine(n0, float(GIB), lo, 1024.0, float(GIB))

    monkeypatch.setattr(startup_module, "activation_line", fake_line)
    with caplog.at_level("INFO", logger="greenlane.engine"):
        stub.activation_reserve(model, lambda pool: None)  # type: ignore[arg-type,return-value]
    assert "measuring the activation peak: dry-run prefills of up to" in seen[0]
    assert "activation peak measured in " in caplog.text
    assert "activation peak measured" not in seen[0]


def test_start_up_says_which_model_it_loaded_and_how_long_it_took(caplog) -> None:
    with caplog.at_level("INFO", logger="greenlane.engine"):
        engine = Engine(EngineConfig(model="random:tiny", device="cpu"), lambda outs: None)
    try:
        assert "model random:tiny loaded in " in caplog.text and "(cpu, " in caplog.text
        # How large the KV cache came out, and from what (vLLM logs its blocks too).
        n = engine.block_manager.num_blocks
        assert f"KV cache: {n} blocks of 16 tokens, {16 * n} tokens, " in caplog.text
        assert "(--cpu-kv-cache-gb)" in caplog.text
    finally:
        engine.shutdown()


def _sized_chunk(**cfg: object) -> int:
    """The chunk an engine of the 8B shape on the fake device sizes."""
    config = EngineConfig(model="random:llama-3.1-8b", **cfg)  # type: ignore[arg-type]
    return size_prefill_chunk(
        config, get_preset("llama-3.1-8b"), torch.device("cuda"), torch.bfloat16, 0
    )


def test_the_auto_chunk_follows_the_memory_the_pool_and_activations_share(fake_gpu, caplog):
    """16,384 where the pool is tens of GiB; smaller under a tight cap, where the chunk's
    temporaries come out of the longest prompt's room."""
    state, _ = fake_gpu
    state["reserved"] = 16 * GIB  # this process holds the 8B's weights
    mc = get_preset("llama-3.1-8b")
    # 90 % of 100 GiB minus 40 in use: 50 GiB shared; 16,384's temporaries are ~1.6 GiB.
    assert chunk_temporaries_bytes(mc, 16384, 2) == pytest.approx(1.57 * GIB, rel=0.01)
    with caplog.at_level("INFO", logger="greenlane.engine"):
        assert _sized_chunk() == 16384
    assert "hybrid prefill's chunk: 16384 tokens (auto" in caplog.text
    # A 24 GB cap: 8 GiB shared, of which 5 % is 0.4 GiB: 4,096's 0.39 GiB fits, by a hair.
    assert _sized_chunk(max_gpu_memory_gb=24) == 4096
    # 20 GB: 4 GiB shared; 2,048, the old fixed chunk, is the smallest choice.
    assert _sized_chunk(max_gpu_memory_gb=20) == 2048
    # A pool asked for: the chunk is sized from what is left beside it (16,384 needs 31 GiB,
    # 8,192 16 GiB, 4,096 8 GiB).
    per_block = bytes_per_block(mc, 16, torch.bfloat16)
    for pool_gib, chunk in ((10, 16384), (20, 8192), (44, 2048)):
        assert _sized_chunk(num_kv_blocks=int(pool_gib * GIB // per_block)) == chunk


def test_the_rule_takes_the_largest_choice_within_the_share_else_the_smallest() -> None:
    mc = get_preset("llama-3.1-8b")
    for chunk in PREFILL_CHUNK_CHOICES:
        need = chunk_temporaries_bytes(mc, chunk, 2) / CHUNK_MEMORY_SHARE
        assert auto_prefill_chunk_tokens(mc, 2, need) == chunk
        if chunk != PREFILL_CHUNK_CHOICES[-1]:
            assert auto_prefill_chunk_tokens(mc, 2, need - 1) < chunk
    assert auto_prefill_chunk_tokens(mc, 2, 0.0) == PREFILL_CHUNK_CHOICES[-1]


def test_an_unsized_chunk_reads_2048_and_a_given_one_is_kept() -> None:
    """On the CPU the engine does not size it: hybrid prefill chunks at 2,048 as before."""
    assert EngineConfig(model="random:tiny").hybrid_form()[0] == PREFILL_CHUNK_TOKENS_UNSIZED
    assert EngineConfig(model="random:tiny", prefill_chunk_tokens=512).hybrid_form()[0] == 512
    assert EngineConfig(model="random:tiny", hybrid_prefill=False).hybrid_form()[0] is None
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        EngineConfig(model="random:tiny", prefill_chunk_tokens=0)
    engine = Engine(EngineConfig(model="random:tiny", device="cpu"), lambda outs: None)
    try:
        assert engine.config.prefill_chunk_tokens is None
        assert engine.fresh_stats()["prefill_chunk_tokens"] == PREFILL_CHUNK_TOKENS_UNSIZED
    finally:
        engine.shutdown()
