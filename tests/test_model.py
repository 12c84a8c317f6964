"""Our Llama-family model against `transformers` (the reference), hybrid prefill, the loader,
configs and presets. CPU, float32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from sdpa_reference import CausalSDPA

from runtime.model.config import ModelConfig, RopeScaling
from runtime.model.loader import load_model
from runtime.model.presets import PRESETS

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Zürich, 東京 and São Paulo are cities; 🙂 is an emoji.",
    "Once upon a time, " * 12,
]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def our_logits(model, ids: list[int], start_pos: int = 0, chunk_tokens: int | None = None):
    x = torch.tensor(ids)
    pos = torch.arange(start_pos, start_pos + len(ids))
    with torch.inference_mode():
        return model.compute_logits(model(x, pos, CausalSDPA(), chunk_tokens=chunk_tokens))


def hf_logits(hf_model, ids: list[int], start_pos: int = 0) -> torch.Tensor:
    pos = torch.arange(start_pos, start_pos + len(ids))[None]
    with torch.inference_mode():
        return hf_model(torch.tensor([ids]), position_ids=pos).logits[0].float()


# --- real weights -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(default_model_dir: Path):
    model, cfg, tok = load_model(str(default_model_dir), torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model, cfg, tok, hf.eval()


def test_smollm2_logits_match_transformers(smollm2) -> None:
    model, _, tok, hf = smollm2
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours, ref = our_logits(model, ids), hf_logits(hf, ids)
        assert ours.shape == ref.shape == (len(ids), 49152)
        assert ours.dtype == torch.float32
        assert rel_err(ours, ref) < 1e-4, prompt
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_answers_paris(smollm2) -> None:
    model, cfg, tok, _ = smollm2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    ids = tok.encode(prompt)
    out: list[int] = []
    for _ in range(12):
        nxt = int(our_logits(model, ids + out)[-1].argmax())
        if nxt in cfg.eos_token_ids:
            break
        out.append(nxt)
    assert "Paris" in tok.decode(out)


def test_hybrid_prefill_equals_unchunked_on_smollm2(smollm2) -> None:
    model, _, tok, _ = smollm2
    ids = tok.encode(PROMPTS[3])
    full = our_logits(model, ids)
    # Chunking changes matmul shapes, hence fp32 rounding (~1e-6 relative); a real bug is ~1e-1.
    for chunk in (1, 7, 16, len(ids) - 1):
        chunked = our_logits(model, ids, chunk_tokens=chunk)
        assert rel_err(chunked, full) < 2e-5, chunk
        assert torch.equal(chunked.argmax(-1), full.argmax(-1))


# --- tiny random configs against transformers ------------------------------------------------


def _tiny_llama3_scaled() -> ModelConfig:
    # Llama-3 RoPE scaling with a short original context so every frequency band is exercised.
    base = PRESETS["tiny"]
    return ModelConfig(
        **{
            **{f: getattr(base, f) for f in base.__dataclass_fields__},
            "tie_word_embeddings": False,
            "qkv_bias": True,
            "o_bias": True,
            "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
        }
    )


def _hf_random_folder(cfg: ModelConfig, tmp: Path, default_model_dir: Path, seed: int):
    """A HF model with seeded random weights (biases and norm weights randomised too, so they
    are actually tested), saved as a HF folder with the SmolLM2 tokenizer files."""
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_config())
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    hf.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / f, tmp / f)
    return hf


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3", "llama3-scaled"])
def test_tiny_random_logits_match_transformers(preset, tmp_path, default_model_dir) -> None:
    cfg = _tiny_llama3_scaled() if preset == "llama3-scaled" else PRESETS[preset]
    hf = _hf_random_folder(cfg, tmp_path, default_model_dir, seed=1234)
    model, loaded_cfg, _ = load_model(str(tmp_path), torch.float32, "cpu")
    assert loaded_cfg.architecture == cfg.architecture
    assert (loaded_cfg.qkv_bias, loaded_cfg.qk_norm) == (cfg.qkv_bias, cfg.qk_norm)
    gen = torch.Generator().manual_seed(0)
    for start_pos in (0, 1000):  # a far offset exercises RoPE (and its scaling) at long range
        ids = torch.randint(0, cfg.vocab_size, (37,), generator=gen).tolist()
        ours, ref = our_logits(model, ids, start_pos), hf_logits(hf, ids, start_pos)
        assert rel_err(ours, ref) < 1e-4, (preset, start_pos)
        # hybrid prefill on the same model
        chunked = our_logits(model, ids, start_pos, chunk_tokens=8)
        assert rel_err(chunked, ours) < 2e-5, (preset, start_pos)


def test_forward_layers_in_slices_equals_forward() -> None:
    model, cfg, _ = load_model("random:tiny-qwen3", torch.float32, "cpu", seed=3)
    ids = torch.randint(0, cfg.vocab_size, (29,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(29)
    attn = CausalSDPA()
    with torch.inference_mode():
        full = model(ids, pos, attn)
        for chunk in (None, 5):
            h, residual = model.embed(ids), None
            h, residual = model.forward_layers(h, residual, pos, attn, 0, 1, chunk)
            h, residual = model.forward_layers(h, residual, pos, attn, 1, cfg.num_layers, chunk)
            assert rel_err(model.final_norm(h, residual), full) < 2e-5, chunk


# --- random presets, configs, loader errors ---------------------------------------------------


def test_random_preset_is_seeded_and_sane_in_bf16() -> None:
    a, cfg, tok = load_model("random:tiny", torch.bfloat16, "cpu", seed=7)
    b, _, _ = load_model("random:tiny", torch.bfloat16, "cpu", seed=7)
    c, _, _ = load_model("random:tiny", torch.bfloat16, "cpu", seed=8)
    assert a.embed_tokens.weight.dtype == torch.bfloat16
    assert a.rotary.cos_sin_cache.dtype == torch.float32
    assert torch.equal(a.layers[0].mlp.gate_up_proj.weight, b.layers[0].mlp.gate_up_proj.weight)
    assert not torch.equal(a.layers[0].mlp.gate_up_proj.weight, c.layers[0].mlp.gate_up_proj.weight)
    assert cfg.eos_token_ids == tok.eos_token_ids and cfg.eos_token_ids
    logits = our_logits(a, tok.encode("hello world, this is a test"))
    assert torch.isfinite(logits).all()
    assert 0.3 < float(logits.std(dim=-1).mean()) < 5.0  # neither flat nor one-hot


# Published parameter counts: Llama-3.1-8B 8.03B, Qwen2.5-3B 3.09B, -7B 7.62B, -32B 32.76B.
@pytest.mark.parametrize(
    ("preset", "num_params"),
    [
        ("llama-3.1-8b", 8_030_261_248),
        ("qwen2.5-3b", 3_085_938_688),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen2.5-32b", 32_763_876_352),
    ],
)
def test_large_presets_have_published_sizes(preset: str, num_params: int) -> None:
    cfg = PRESETS[preset]
    assert cfg.num_params == num_params
    from runtime.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == num_params


def test_model_config_from_hf_variants() -> None:
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "max_position_embeddings": 1024,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [1, 2],
    }
    cfg = ModelConfig.from_hf_config(llama)
    assert cfg.head_dim == 16 and cfg.eos_token_ids == (1, 2)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    # transformers 5 style: theta inside rope_parameters
    v5 = {
        **llama,
        "rope_scaling": None,
        "rope_parameters": {"rope_theta": 7.0, "rope_type": "default"},
    }
    del v5["rope_theta"]
    cfg5 = ModelConfig.from_hf_config(v5)
    assert cfg5.rope_theta == 7.0 and cfg5.rope_scaling is None
    qwen2 = ModelConfig.from_hf_config({**llama, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.o_bias
    qwen3 = ModelConfig.from_hf_config(
        {**llama, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32}
    )
    assert qwen3.qk_norm and qwen3.head_dim == 32
    with pytest.raises(ValueError, match="unsupported architecture 'MistralForCausalLM'"):
        ModelConfig.from_hf_config({**llama, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match="rope scaling"):
        ModelConfig.from_hf_config({**llama, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_loader_errors(tmp_path: Path, default_model_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"), torch.float32, "cpu")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path), torch.float32, "cpu")
    with pytest.raises(ValueError, match="unknown random preset"):
        load_model("random:gpt-17", torch.float32, "cpu")
    cfg = PRESETS["tiny"]
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, tmp_path / f)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")
    # a checkpoint missing one projection
    from safetensors.torch import save_file

    model, _, _ = load_model("random:tiny", torch.float32, "cpu")
    state = {
        f"model.{k}": v.contiguous()
        for k, v in model.state_dict().items()
        if "rotary" not in k and "qkv_proj" not in k
    }
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks tensors"):
        load_model(str(tmp_path), torch.float32, "cpu")
    bad = {**cfg.to_hf_config(), "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_hybrid_prefill_bounds_mlp_rows(monkeypatch) -> None:
    """The point of hybrid prefill: the [rows, 2 * intermediate] MLP activation never covers
    more than C rows, while attention still sees all T tokens at once."""
    from runtime.model import ops

    model, cfg, _ = load_model("random:tiny", torch.float32, "cpu", seed=0)
    mlp_rows: list[int] = []
    attn_rows: list[int] = []
    real = ops.silu_and_mul

    def spy(x: torch.Tensor) -> torch.Tensor:
        mlp_rows.append(x.shape[0])
        return real(x)

    class SpyAttn(CausalSDPA):
        def forward(self, layer_idx, q, k, v):
            attn_rows.append(q.shape[0])
            return super().forward(layer_idx, q, k, v)

    monkeypatch.setattr(ops, "silu_and_mul", spy)
    ids = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids, torch.arange(50), SpyAttn(), chunk_tokens=16)
    assert mlp_rows == [16, 16, 16, 2] * cfg.num_layers
    assert attn_rows == [50] * cfg.num_layers


def test_a_hybrid_prefill_longer_than_the_fused_rope_cap_rotates_chunk_by_chunk(
    monkeypatch,
) -> None:
    """A backend that fuses RoPE into its pool write does so only up to FUSED_ROPE_MAX_TOKENS
    rows; a longer hybrid prefill must rotate q/k chunk by chunk into the layer's buffers
    (rope=None to the backend), not hand them over un-rotated for a whole-prompt copy, and give
    the same hidden states. Shorter forwards still hand RoPE over."""
    import runtime.attention.base as base
    from runtime.model import ops

    monkeypatch.setattr(base, "FUSED_ROPE_MAX_TOKENS", 24)
    model, cfg, _ = load_model("random:tiny", torch.float32, "cpu", seed=0)
    ropes: list[bool] = []

    class FusingSpy(CausalSDPA):
        fuses_rope = True

        def forward(self, layer_idx, q, k, v, rope=None):
            ropes.append(rope is not None)
            if rope is not None:
                q, k = ops.apply_rope(q, k, *rope)
            return super().forward(layer_idx, q, k, v)

    gen = torch.Generator().manual_seed(0)
    for n, handed_over in ((50, False), (20, True)):
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
        ropes.clear()
        with torch.inference_mode():
            want = model(ids, torch.arange(n), CausalSDPA(), chunk_tokens=16)
            got = model(ids, torch.arange(n), FusingSpy(), chunk_tokens=16)
        assert ropes == [handed_over] * cfg.num_layers
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_hybrid_prefill_has_attention_write_into_the_consumed_hidden_buffer() -> None:
    """With a backend that writes into `out=`, a hybrid-prefill layer hands it the layer's
    hidden-state buffer (consumed by then): no second [T, H] tensor at the activation peak.
    The hidden states equal those of a backend that allocates its output; a forward short
    enough not to be chunked passes no `out=`."""
    model, cfg, _ = load_model("random:tiny", torch.float32, "cpu", seed=0)
    handed: list[bool] = []

    class WritesOut(CausalSDPA):
        writes_out = True

        def forward(self, layer_idx, q, k, v, out=None):
            o = super().forward(layer_idx, q, k, v)
            if out is None:
                handed.append(False)
                return o
            assert out.shape == q.shape and out.dtype == q.dtype
            for t in (q, k, v):  # out must alias none of the inputs
                assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
            handed.append(out.untyped_storage().data_ptr() == hidden_ptr[0])
            return out.copy_(o)

    hidden_ptr = [0]
    real_embed = model.embed

    def embed(ids):
        h = real_embed(ids)
        hidden_ptr[0] = h.untyped_storage().data_ptr()
        return h

    model.embed = embed  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    for n, chunk, want_out in ((50, 16, True), (12, 16, False)):
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
        handed.clear()
        with torch.inference_mode():
            want = model(ids, torch.arange(n), CausalSDPA(), chunk_tokens=chunk)
            got = model(ids, torch.arange(n), WritesOut(), chunk_tokens=chunk)
        assert handed == [want_out] * cfg.num_layers
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
