"""Write a Greenlane random-weight preset as a Hugging Face model folder, so another server
(vLLM) can load the very weights that Greenlane's `--model random:<preset>` runs.

    python -m bench.peer.export_hf --preset llama-3.1-8b --out /tmp/peer-8b --device cuda

The weights are made by Greenlane's own loader (`load_model("random:<preset>", dtype, device,
seed)`: the same code, seed, dtype and device as the server's), then written un-fused (q/k/v and
gate/up split back into HF's names) as safetensors, tensor by tensor through the CPU, never as
a float32 copy of the model. Seeded random draws depend on the device and dtype: export on the
device and in the dtype the server runs (CUDA, bfloat16 for the benchmarks), or have both
servers load the exported folder (then they hold the same weights by construction).

The folder: config.json (the preset's architecture and shapes, `ModelConfig.to_hf_config`),
generation_config.json (bos/eos only, so no server picks up sampling defaults from it),
model.safetensors or model-0000i-of-0000n.safetensors + model.safetensors.index.json
(shards of about --shard-gb), and the default model's tokenizer files (the tokenizer every
random preset uses: tokenizer.json, tokenizer_config.json, chat_template.jinja).

The tokenizer is padded to the model's vocabulary. The random presets have more rows
(Llama-3.1-8B: 128,256) than the SmolLM2 tokenizer has ids (49,152). Greenlane samples only
among its tokenizer's ids; vLLM samples among all of the model's rows, and ids without text
give empty deltas (one chat stream of 240 had no text at all on 2026-12-02 and counted as
failed). With placeholder tokens `<unused_N>` for the missing ids, both servers sample from
the same distribution and every id has text. No text ever encodes to a placeholder: they are
in the BPE vocabulary but no merge makes them, and the pre-tokenizer splits `<`, letters,
`_` and digits apart.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.model.config import ModelConfig
from runtime.model.llama import LlamaForCausalLM
from runtime.model.loader import RANDOM_PREFIX, load_model, tokenizer_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_tensors(model: LlamaForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor view on the model's device) in checkpoint order: fused q/k/v and
    gate/up are split back into q_proj/k_proj/v_proj and gate_proj/up_proj (the inverse of
    `runtime.model.loader._target`); a tied lm_head is left out, as HF checkpoints do."""
    cfg = model.cfg
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    splits = {
        "self_attn.qkv_proj": (
            ("q_proj", 0, q),
            ("k_proj", q, q + kv),
            ("v_proj", q + kv, q + 2 * kv),
        ),
        "mlp.gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter)),
    }
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                yield name, p
            continue
        stem, _, leaf = name.rpartition(".")  # e.g. layers.3.self_attn.qkv_proj / weight
        fused = next((k for k in splits if stem.endswith(k)), None)
        if fused is None:
            yield f"model.{name}", p
            continue
        layer = stem[: -len(fused)]  # "layers.3."
        parent = fused.split(".")[0]
        for proj, start, end in splits[fused]:
            yield f"model.{layer}{parent}.{proj}.{leaf}", p[start:end]


def shard_plan(
    tensors: list[tuple[str, torch.Tensor]], shard_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors in shards of at most `shard_bytes` (a bigger tensor alone)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards


def pad_tokenizer_json(doc: dict, vocab_size: int) -> int:
    """Give every id below `vocab_size` a token: placeholders `<unused_N>` in a BPE model's
    vocabulary (in place). Returns how many were added."""
    model = doc["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"can only pad a BPE tokenizer, not {model.get('type')!r}")
    vocab: dict[str, int] = model["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in doc.get("added_tokens", [])}
    added = 0
    for i in range(vocab_size):
        if i in taken:
            continue
        name = f"<unused_{i}>"
        if name in vocab:
            raise ValueError(f"{name} already names id {vocab[name]}")
        vocab[name] = i
        added += 1
    return added


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    out = cfg.to_hf_config()
    name = str(dtype).removeprefix("torch.")
    out["torch_dtype"] = out["dtype"] = name
    out["use_cache"] = True
    return out


@torch.no_grad()
def export(
    preset: str,
    out: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    shard_gb: float = 5.0,
    pad_tokenizer: bool = True,
    log: bool = True,
) -> dict:
    """Write the folder (replacing `out`); returns a summary (files, bytes, seconds)."""
    t0 = time.monotonic()
    spec = preset if preset.startswith(RANDOM_PREFIX) else RANDOM_PREFIX + preset
    model, cfg, _ = load_model(spec, dtype, device, seed=seed)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_init = time.monotonic() - t0
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors = list(hf_tensors(model))
    shards = shard_plan(tensors, int(shard_gb * 2**30))
    weight_map: dict[str, str] = {}
    total = 0
    files = []
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        # One shard at a time through host memory; `.to("cpu")` (or a clone on CPU) gives each
        # slice its own storage, which safetensors requires.
        state = {
            n: (t.to("cpu") if t.device.type != "cpu" else t.clone()).contiguous() for n, t in shard
        }
        save_file(state, str(out / fname), metadata={"format": "pt"})
        for n, t in state.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
        files.append(fname)
        del state
        if log:
            print(f"[export_hf] wrote {fname}", file=sys.stderr, flush=True)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok_dir = tokenizer_dir(spec)
    for f in TOKENIZER_FILES:
        if (tok_dir / f).is_file():
            shutil.copyfile(tok_dir / f, out / f)
    padded = 0
    if pad_tokenizer:
        doc = json.loads((out / "tokenizer.json").read_text())
        padded = pad_tokenizer_json(doc, cfg.vocab_size)
        if padded:
            (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    summary = {
        "preset": preset.removeprefix(RANDOM_PREFIX),
        "seed": seed,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "files": files,
        "bytes": total,
        "tokenizer_placeholders": padded,
        "init_s": round(t_init, 2),
        "total_s": round(time.monotonic() - t0, 2),
    }
    (out / "greenlane_export.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.peer.export_hf", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--preset", required=True, help="a random preset, e.g. llama-3.1-8b (or random:NAME)"
    )
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0, help="Greenlane's --seed (default 0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shard-gb", type=float, default=5.0)
    p.add_argument(
        "--no-pad-tokenizer",
        action="store_true",
        help="keep the tokenizer as it is (ids past it then have no text)",
    )
    args = p.parse_args(argv)
    summary = export(
        args.preset,
        args.out,
        seed=args.seed,
        dtype=DTYPES[args.dtype],
        device=args.device,
        shard_gb=args.shard_gb,
        pad_tokenizer=not args.no_pad_tokenizer,
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
