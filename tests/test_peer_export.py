"""bench/peer/export_hf.py: a random preset written as a Hugging Face folder holds exactly the
weights of Greenlane's `random:<preset>` (same seed, dtype, device), loads through our HF
loader with the same logits, and gives `transformers` the same greedy tokens as our engine:
same weights, same answers (what issue 18's side-by-side with vLLM relies on). CPU."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest
import torch
from sdpa_reference import CausalSDPA

from bench.peer.export_hf import export, hf_tensors, shard_plan
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.model.loader import load_model
from runtime.request import EngineOutput, Request, RequestKind, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, " * 6,
]
NUM_TOKENS = 12


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        x, pos = torch.tensor(ids), torch.arange(len(ids))
        return model.compute_logits(model(x, pos, CausalSDPA())).float()


@pytest.fixture(scope="module")
def tiny_fp32(tmp_path_factory, default_model_dir) -> Path:  # noqa: ARG001 - tokenizer files
    out = tmp_path_factory.mktemp("peer") / "tiny-fp32"
    export("tiny", out, dtype=torch.float32, device="cpu", log=False)
    return out


def test_folder_layout_and_config(tiny_fp32: Path) -> None:
    names = {p.name for p in tiny_fp32.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((tiny_fp32 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    gen = json.loads((tiny_fp32 / "generation_config.json").read_text())
    assert set(gen) == {"bos_token_id", "eos_token_id"}  # no sampling defaults
    # tiny has the tokenizer's 49,152 rows: nothing to pad.
    assert (
        json.loads((tiny_fp32 / "greenlane_export.json").read_text())["tokenizer_placeholders"] == 0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_loader_gets_the_random_weights_exactly(tmp_path, tiny_fp32, dtype) -> None:
    folder = tiny_fp32
    if dtype != torch.float32:
        folder = tmp_path / "tiny-bf16"
        export("tiny", folder, dtype=dtype, device="cpu", log=False)
    ref, ref_cfg, _ = load_model("random:tiny", dtype, "cpu")
    got, got_cfg, _ = load_model(str(folder), dtype, "cpu")
    assert got_cfg.eos_token_ids == ref_cfg.eos_token_ids
    ref_params = dict(ref.named_parameters())
    for name, p in got.named_parameters():
        assert p.dtype == dtype
        assert torch.equal(p, ref_params[name]), name
    ids = list(range(5, 40))
    assert torch.equal(_logits(got, ids), _logits(ref, ids))


def test_sharded_qwen2_round_trip(tmp_path) -> None:
    """Biases, an untied head and several shards with an index."""
    out = tmp_path / "tq2"
    summary = export("tiny-qwen2", out, dtype=torch.float32, shard_gb=0.01, log=False)
    assert len(summary["files"]) > 1 and (out / "model.safetensors.index.json").is_file()
    ref, _, _ = load_model("random:tiny-qwen2", torch.float32, "cpu")
    got, _, _ = load_model(str(out), torch.float32, "cpu")
    ref_params = dict(ref.named_parameters())
    assert all(torch.equal(p, ref_params[n]) for n, p in got.named_parameters())


def test_tokenizer_padded_to_the_model_vocabulary(tmp_path, monkeypatch, default_model_dir) -> None:  # noqa: ARG001
    """A preset with more rows than the tokenizer has ids gets placeholder tokens for the rest:
    both servers then sample among the same ids and every id has text; text encodes as before."""
    import dataclasses

    from tokenizers import Tokenizer as HFTokenizer

    from bench.peer.export_hf import pad_tokenizer_json
    from runtime.model import presets
    from runtime.model.loader import tokenizer_dir

    big = dataclasses.replace(presets.PRESETS["tiny"], vocab_size=presets.SMOLLM2_VOCAB + 64)
    monkeypatch.setitem(presets.PRESETS, "tiny-bigvocab", big)
    out = tmp_path / "tiny-bigvocab"
    summary = export("tiny-bigvocab", out, dtype=torch.float32, device="cpu", log=False)
    assert summary["tokenizer_placeholders"] == 64
    orig = HFTokenizer.from_file(str(tokenizer_dir("random:tiny") / "tokenizer.json"))
    padded = HFTokenizer.from_file(str(out / "tokenizer.json"))
    assert padded.get_vocab_size(with_added_tokens=True) == big.vocab_size
    text = "Hi <unused_49160> there <|im_start|>user 123 _x_ " + PROMPTS[1]
    assert padded.encode(text).ids == orig.encode(text).ids
    assert padded.decode([presets.SMOLLM2_VOCAB + 3]) == f"<unused_{presets.SMOLLM2_VOCAB + 3}>"
    _, cfg, tok = load_model(str(out), torch.float32, "cpu")
    assert cfg.vocab_size == tok.vocab_size == big.vocab_size  # Greenlane samples every row
    # Presets that match the tokenizer are left alone; a non-BPE tokenizer is refused.
    assert pad_tokenizer_json({"model": {"type": "BPE", "vocab": {"a": 0}}}, 1) == 0
    with pytest.raises(ValueError, match="BPE"):
        pad_tokenizer_json({"model": {"type": "Unigram", "vocab": []}}, 4)


def test_hf_names_and_shards() -> None:
    model, cfg, _ = load_model("random:tiny", torch.float32, "cpu")
    names = [n for n, _ in hf_tensors(model)]
    assert "model.layers.0.self_attn.k_proj.weight" in names
    assert "model.layers.1.mlp.up_proj.weight" in names
    assert "lm_head.weight" not in names  # tied
    assert len(names) == len(set(names))
    shards = shard_plan(list(hf_tensors(model)), 2**20)
    assert sum(len(s) for s in shards) == len(names)


def _engine_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    outs: dict[str, list[EngineOutput]] = {}
    cv = threading.Condition()

    def sink(step_outs: list[EngineOutput]) -> None:
        with cv:
            for o in step_outs:
                outs.setdefault(o.request_id, []).append(o)
            cv.notify_all()

    engine = Engine(
        EngineConfig(model=str(folder), dtype="float32", device="cpu", block_size=16), sink
    )
    engine.start()
    try:
        sp = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add(Request(f"p{i}", RequestKind.GENERATE, p, sp))

        def done() -> bool:
            return all(
                outs.get(f"p{i}") and outs[f"p{i}"][-1].finished for i in range(len(prompts))
            )

        with cv:
            assert cv.wait_for(done, timeout=60)
    finally:
        engine.shutdown(0)
    assert all(o[-1].error is None for o in outs.values())
    return [[t for o in outs[f"p{i}"] for t in o.new_token_ids] for i in range(len(prompts))]


def test_transformers_gives_the_same_greedy_tokens(tiny_fp32: Path) -> None:
    transformers = pytest.importorskip("transformers")
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_fp32, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as exc:  # pragma: no cover - depends on the version
        pytest.skip(f"transformers cannot load the exported architecture: {exc}")
    hf.eval()
    ours_model, _, tok = load_model(str(tiny_fp32), torch.float32, "cpu")
    prompts = [tok.encode(p) for p in PROMPTS]
    # Same logits (float32; different kernels, so not bit-exact) ...
    with torch.inference_mode():
        for ids in prompts:
            ref = hf(torch.tensor([ids])).logits[0].float()
            ours = _logits(ours_model, ids)
            assert float((ours - ref).norm() / ref.norm()) < 1e-5
    # ... and the same greedy tokens from our engine and from transformers' generate.
    ours_tokens = _engine_greedy(tiny_fp32, prompts)
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            x = torch.tensor([ids])
            gen = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=NUM_TOKENS,
                min_new_tokens=NUM_TOKENS,
                pad_token_id=0,
                eos_token_id=None,
            )
            assert gen[0, len(ids) :].tolist() == ours_tokens[i], f"prompt {i}"


# --- the device-side helpers (bench/peer), checked here without a server ---------------------


def test_same_answers_compare_greedy() -> None:
    from tokenizers import Tokenizer

    from bench.peer.same_answers import compare_greedy
    from runtime.model.loader import tokenizer_dir

    tok = Tokenizer.from_file(str(tokenizer_dir("random:tiny") / "tokenizer.json"))
    a, b, oov = tok.token_to_id("The"), tok.token_to_id("go"), 100_000
    gl = {
        "tokens": ["The", "go", ""],
        "logprobs": [-1.0, -2.0, -3.0],
        "top": [{"The": -1.0}, {"go": -2.0, "The": -2.05}, {"": -3.0}],
    }

    def vl(ids: list[int], lps: list[float]) -> dict:
        return {"tokens": [f"token_id:{i}" for i in ids], "logprobs": lps}

    same = compare_greedy(tok, gl, vl([a, b, oov], [-1.01, -2.02, -3.1]), 0.15, 0.15)
    assert same["ok"] and same["matched"] == 3 and not same["near_tie"]
    tie = compare_greedy(tok, gl, vl([a, a, oov], [-1.0, -2.04, -3.0]), 0.15, 0.15)
    assert tie["ok"] and tie["near_tie"] and tie["matched"] == 1
    # An out-of-vocabulary token decodes to "" on both sides: the logprob tells them apart.
    wrong = compare_greedy(tok, gl, vl([a, b, oov], [-1.0, -2.0, -5.0]), 0.15, 0.15)
    assert not wrong["ok"] and wrong["first_difference"]["position"] == 2


def test_peer_scripts_parse() -> None:
    import subprocess

    root = Path(__file__).resolve().parents[1]
    for script in ("bench/peer/run.sh", "bench/peer/prepare.sh", "bench/wheel_pieces.sh"):
        subprocess.run(["bash", "-n", str(root / script)], check=True)
    from bench.peer import check_vllm, longest_prompt, profile_steps, select_packages  # noqa: F401

    assert "vllm" in select_packages.CARRIED
    assert not set(select_packages.CARRIED) & set(select_packages.LEFT_OUT_NOTES)


def test_same_answers_merged_steps_check_against_a_cpu_server() -> None:
    """Check 3 of bench/peer/same_answers.py against a real Greenlane (random:tiny, CPU): the
    prompts, sent beside decoding background streams, give the tokens they gave alone, and the
    step trace shows steps that prefilled beside more decodes; a changed reference fails it."""
    import httpx
    from server_thread import running_server

    from bench.peer.same_answers import complete, merged_steps_check

    rng = random.Random(3)
    prompts = [[rng.randrange(5, 40000) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    with running_server(model="random:tiny", max_model_len=1024, device="cpu") as srv:
        with httpx.Client(timeout=120.0) as client:
            solo = [complete(client, srv.url, ids, 8) for ids in prompts]
            good = merged_steps_check(client, srv.url, prompts, solo, 8, 0.15, 0.15)
            assert good["ok"], good
            assert good["steps"]["prefill_beside_more_decodes"] >= 1
            assert all(r["matched"] == 8 or r["near_tie"] for r in good["prompts"])
            # A reference whose first pick differs and ranks the real one outside its top-5: a
            # mismatch, not a near tie.
            bad_ref = [
                dict(r, tokens=["<nope>", *r["tokens"][1:]],
                     top=[{"<nope>": r["logprobs"][0]}, *r["top"][1:]])
                for r in solo
            ]  # fmt: skip
            bad = merged_steps_check(client, srv.url, prompts, bad_ref, 8, 0.15, 0.15)
            assert not bad["ok"]
            assert all(r["first_difference"]["position"] == 0 for r in bad["prompts"])
