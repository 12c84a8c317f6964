"""EngineConfig's cross-option checks (runtime/config.py)."""

from __future__ import annotations

import pytest

from runtime.config import EngineConfig
from runtime.partition.setup import controller_config_from


def test_layer_slicing_takes_either_tbt_target() -> None:
    # auto's controller takes --partition-tbt-slo-ms, else --tbt-slo-ms (docs/partition.md,
    # "how auto chooses"): either one sizes the layer slices.
    with pytest.raises(ValueError, match="needs partition_tbt_slo_ms or tbt_slo_ms"):
        EngineConfig(partition="auto", partition_layer_slicing=True)
    only_tbt = EngineConfig(partition="auto", partition_layer_slicing=True, tbt_slo_ms=80.0)
    cc = controller_config_from(only_tbt)
    assert cc.layer_slicing and cc.tbt_slo_ms == 80.0
    only_partition = EngineConfig(
        partition="auto", partition_layer_slicing=True, partition_tbt_slo_ms=60.0
    )
    assert controller_config_from(only_partition).tbt_slo_ms == 60.0
    both = EngineConfig(
        partition="auto", partition_layer_slicing=True, tbt_slo_ms=80.0, partition_tbt_slo_ms=60.0
    )
    assert controller_config_from(both).tbt_slo_ms == 60.0


def test_layer_slicing_with_only_tbt_slo_ms_through_the_cli_options() -> None:
    from app.settings import Settings

    s = Settings(partition="auto", partition_layer_slicing=True, tbt_slo_ms=80.0)
    cfg = s.to_engine_config(resolve_calibration=False)
    assert cfg.partition_layer_slicing and cfg.partition_tbt_slo_ms is None


def test_fused_rope_kv_write_modes() -> None:
    """auto fuses with FlashInfer only (measured there); the torch backend (the CPU's, the fp32
    path, the fallback) fuses only when asked; a typo is rejected, not read as false."""
    import torch

    from runtime.engine import make_attention_backend
    from runtime.kv.kv_pool import KVPool

    with pytest.raises(ValueError, match="fused_rope_kv_write"):
        EngineConfig(fused_rope_kv_write="yes")
    pool = KVPool(1, 4, 4, num_kv_heads=1, head_dim=8, dtype=torch.float32, device="cpu")
    for mode, fused in (("auto", False), ("false", False), ("true", True)):
        be = make_attention_backend(EngineConfig(fused_rope_kv_write=mode), pool, 2)
        assert be.name == "torch" and be.fuses_rope is fused, mode


def test_the_cap_on_steps_with_decodes_resolves_per_device() -> None:
    """auto: 2048 on CUDA (where it was measured), none on CPU (a 2k-token step there takes
    seconds); none: the budget alone; a count as given; anything else is refused."""
    auto = EngineConfig()
    assert auto.mixed_step_tokens(on_cuda=True) == 2048
    assert auto.mixed_step_tokens(on_cuda=False) is None
    assert EngineConfig(mixed_step_token_budget="none").mixed_step_tokens(on_cuda=True) is None
    assert EngineConfig(mixed_step_token_budget="512").mixed_step_tokens(on_cuda=False) == 512
    for bad in ("0", "-5", "lots", ""):
        with pytest.raises(ValueError, match="mixed_step_token_budget"):
            EngineConfig(mixed_step_token_budget=bad)


def test_the_chunks_fixed_share_is_a_fraction() -> None:
    assert EngineConfig().chunk_fixed_share is None  # the cap alone by default
    assert EngineConfig(chunk_fixed_share=0.15).chunk_fixed_share == 0.15
    for bad in (0.0, 1.0, -0.1, 2.0):
        with pytest.raises(ValueError, match="chunk_fixed_share"):
            EngineConfig(chunk_fixed_share=bad)
