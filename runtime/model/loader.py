"""`load_model(spec, dtype, device)`: build a `LlamaForCausalLM` with its config and tokenizer.

spec:
  "default"          SmolLM2-135M-Instruct, converted once from the bundled GGUF
                     (runtime/model/convert.py)
  "<folder>"         a Hugging Face-format folder: config.json, *.safetensors (single file or
                     sharded with model.safetensors.index.json), tokenizer.json, chat template
  "random:<preset>"  a preset shape (runtime/model/presets.py) with seeded random weights and the
                     SmolLM2 tokenizer

The model is first built on the meta device (no memory, no init), then materialised directly on
the target device in the target dtype, so an 8B random model takes seconds, not minutes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.model.config import ModelConfig
from runtime.model.llama import LlamaForCausalLM
from runtime.model.presets import get_preset
from runtime.tokenizer import Tokenizer

RANDOM_PREFIX = "random:"


def resolve_model_dir(spec: str) -> Path:
    """The folder holding weights/tokenizer for "default" or a folder path."""
    if spec == "default":
        from runtime.model.convert import ensure_default_model

        return ensure_default_model()
    folder = Path(spec).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise NotADirectoryError(f"model path {folder} is not a folder")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model folder {folder} has no config.json")
    return folder


def tokenizer_dir(spec: str) -> Path:
    """The folder holding the tokenizer of a model spec (random presets use the default
    model's)."""
    return resolve_model_dir("default" if spec.startswith(RANDOM_PREFIX) else spec)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of a model spec (random presets use the default model's tokenizer)."""
    if spec.startswith(RANDOM_PREFIX):
        spec = "default"
    folder = resolve_model_dir(spec)
    return Tokenizer.from_dir(folder)


def load_model(
    spec: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer]:
    """Build the model for `spec` on `device` in `dtype`, in eval mode without gradients."""
    device = torch.device(device)
    if spec.startswith(RANDOM_PREFIX):
        cfg = get_preset(spec[len(RANDOM_PREFIX) :])
        tokenizer = load_tokenizer("default")
        cfg = dataclasses.replace(
            cfg, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids
        )
        model = _materialise(cfg, dtype, device)
        init_random_weights(model, seed)
        return model, cfg, tokenizer

    folder = resolve_model_dir(spec)
    hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    cfg = ModelConfig.from_hf_config(hf)
    extra_eos = _generation_eos(folder)
    tokenizer = Tokenizer.from_dir(folder)
    eos = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra_eos, *tokenizer.eos_token_ids]))
    cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    model = _materialise(cfg, dtype, device)
    load_weights(model, folder)
    return model, cfg, tokenizer


def _materialise(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.rotary.rebuild(device)  # float32 cos/sin cache (the dtype cast would lower it)
    model.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Seeded random init, generated on the model's device. Matrices ~ N(0, 1/fan_in) so each
    projection keeps unit scale; embeddings ~ N(0, 1/hidden) so logits have std ~1 (neither
    NaN in bf16 nor a degenerate one-hot distribution); norm weights 1; biases N(0, 0.02)."""
    device = model.embed_tokens.weight.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    hidden = model.cfg.hidden_size
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.02, generator=gen)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            p.normal_(0.0, hidden**-0.5, generator=gen)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)


# --- HF checkpoint loading -------------------------------------------------------------------


def _generation_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards listed in the index are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {folder} (PyTorch .bin checkpoints are not supported)"
        )
    return files


def _iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in _safetensors_files(folder):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                yield key, sf.get_tensor(key)


def _target(cfg: ModelConfig, hf_name: str) -> tuple[str, int, int] | None:
    """Map a HF parameter name to (our name, row start, row end) of the destination; rows are
    None-sliced (whole tensor) when start == end == -1. Returns None for ignored tensors."""
    name = hf_name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq"):
        return None  # old checkpoints store it; we compute RoPE ourselves
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None  # tied: the embedding matrix is the head
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "layers":
        prefix = ".".join(parts[:3])  # layers.N.self_attn / layers.N.mlp
        proj, leaf = parts[3], ".".join(parts[4:])
        fused = {
            "q_proj": ("self_attn.qkv_proj", 0, q),
            "k_proj": ("self_attn.qkv_proj", q, q + kv),
            "v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
            "gate_proj": ("mlp.gate_up_proj", 0, inter),
            "up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
        }
        if proj in fused:
            dest, start, end = fused[proj]
            return f"layers.{parts[1]}.{dest}.{leaf}", start, end
        return f"{prefix}.{proj}.{leaf}" if leaf else name, -1, -1
    return name, -1, -1


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    """Copy a HF checkpoint into `model` (fusing q/k/v and gate/up). Raises ValueError on
    unknown or missing tensors and on shape mismatches."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    # Track filled rows per destination so a missing q/k/v or gate/up part is caught.
    filled: dict[str, int] = dict.fromkeys(params, 0)
    unknown: list[str] = []
    for hf_name, tensor in _iter_checkpoint(folder):
        target = _target(cfg, hf_name)
        if target is None:
            continue
        name, start, end = target
        if name not in params:
            unknown.append(hf_name)
            continue
        p = params[name]
        dest = p if start == -1 else p[start:end]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor.to(device=p.device, dtype=p.dtype))
        filled[name] += tensor.shape[0]
    if unknown:
        raise ValueError(f"{folder}: unexpected tensors in checkpoint: {unknown[:8]}")
    missing = [n for n, p in params.items() if filled[n] != p.shape[0]]
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks tensors for: {missing[:8]}")
