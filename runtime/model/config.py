"""`ModelConfig`: the Llama-family hyper-parameters our model code needs.

Built from a Hugging Face `config.json` (`ModelConfig.from_hf_config`) or from a preset
(`runtime/model/presets.py`). Supported architectures:
  - LlamaForCausalLM (Llama 3.x, SmolLM2): optional attention bias, Llama-3 RoPE scaling
  - Qwen2ForCausalLM (Qwen2 / Qwen2.5): bias on q/k/v (never on o_proj)
  - Qwen3ForCausalLM: per-head RMSNorm on q and k, explicit head_dim
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is "llama3" or "linear" (others are rejected)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on the fused q/k/v projection
    o_bias: bool = False  # bias on o_proj (Llama `attention_bias` sets both)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        qkv_out = self.q_size + 2 * self.kv_size
        attn = self.hidden_size * qkv_out + self.q_size * self.hidden_size
        attn += qkv_out * self.qkv_bias + self.hidden_size * self.o_bias
        attn += 2 * self.head_dim * self.qk_norm
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json`. Raises ValueError for anything we cannot run
        exactly (unknown architecture, activation, MLP bias, unsupported RoPE scaling)."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(hf.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (model_type={hf.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: only 'silu' is implemented")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
            raise ValueError("Qwen2 sliding-window attention is not supported")

        num_q_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_q_heads
        attention_bias = bool(hf.get("attention_bias", False))
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias, o_bias = attention_bias, attention_bias

        rope_theta, scaling = _parse_rope(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_q_heads=num_q_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_q_heads),
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent HF `config.json` dict (used by tests to build reference models)."""
        model_type = {
            "LlamaForCausalLM": "llama",
            "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3",
        }[self.architecture]
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }
        if self.architecture == "LlamaForCausalLM":
            out["attention_bias"] = self.qkv_bias
        elif self.architecture == "Qwen3ForCausalLM":
            out["attention_bias"] = self.qkv_bias
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            out["rope_scaling"] = {
                "rope_type": rs.rope_type,
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        return out


def _arch_from_model_type(model_type: str | None) -> str | None:
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }.get(model_type or "")


def _parse_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (theta + scaling in one dict); older configs
    # have top-level `rope_theta` and `rope_scaling`.
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (params if "rope_type" in params else None)
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", 8192)
            ),
        )
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: llama3, linear)")
