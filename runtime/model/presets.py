"""Shapes for `--model random:<preset>`: real published hyper-parameters with seeded random
weights, for performance work on machines that have no checkpoints.

Tokenizer: every random preset uses the SmolLM2 tokenizer from the converted default model
(`runtime/model/convert.py`). Its ids are < 49152, which is <= every preset's vocab_size, so any
text it encodes is a valid input; the model's extra vocabulary rows are never produced by the
tokenizer and never sampled (the engine samples among its tokenizer's ids:
`ModelRunner.num_sampleable_tokens`).
The `tiny*` presets are small models for tests (fast on CPU) with each supported architecture.
"""

from __future__ import annotations

from runtime.model.config import ModelConfig, RopeScaling

SMOLLM2_VOCAB = 49152

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    "tiny-qwen2": ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=128,
        intermediate_size=352,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        qkv_bias=True,
    ),
    "tiny-qwen3": ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,  # Qwen3 decouples head_dim from hidden_size / num_heads
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        qk_norm=True,
    ),
    # meta-llama/Llama-3.1-8B(-Instruct)
    "llama-3.1-8b": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_scaling=RopeScaling(
            "llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    # Qwen/Qwen2.5-3B(-Instruct)
    "qwen2.5-3b": ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_layers=36,
        num_q_heads=16,
        num_kv_heads=2,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qkv_bias=True,
    ),
    # Qwen/Qwen2.5-7B(-Instruct)
    "qwen2.5-7b": ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_q_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        qkv_bias=True,
    ),
    # Qwen/Qwen2.5-32B(-Instruct)
    "qwen2.5-32b": ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_q_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        qkv_bias=True,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset's config (eos/bos ids are filled in by the loader from the tokenizer)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown random preset {name!r}; available: {', '.join(sorted(PRESETS))}"
        ) from None
