"""lm-evaluation-harness itself (`local-completions`) runs a loglikelihood task against us.

It asks for each choice's loglikelihood with `/v1/completions` (`echo: true, logprobs: 1,
max_tokens: 1`, token-id prompts) and tokenizes through our `/tokenize`, `/detokenize` and
`/tokenizer_info` (its remote tokenizer). The task is a tiny local multiple-choice set in
tests/data/lm_eval/, run with `--limit`.

- Against the fake engine (its prompt logprobs are a known rule): lm-eval's recorded
  loglikelihood and greediness of every choice must equal what that rule gives.
- Against the real engine on `random:tiny` (prompt logprobs computed in the prefill,
  `SamplingParams.prompt_logprobs`): the same run must complete with real loglikelihoods.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_thread import ServerThread, fake_server, running_server

pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra (pip install -e .[dev])")

TASK_DIR = Path(__file__).resolve().parent / "data" / "lm_eval"
TASK = "greenlane_tiny_mc"
LIMIT = 4

pytestmark = pytest.mark.slow


def _run_lm_eval(srv: ServerThread, model: str, out: Path) -> dict:
    """Run `lm_eval run` against `srv`; return its results and logged samples."""
    model_args = ",".join(
        [
            f"model={model}",
            f"base_url={srv.url}/v1/completions",
            "tokenizer_backend=remote",
            "num_concurrent=1",
            "max_retries=1",
            "timeout=60",
        ]
    )
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions"]
    cmd += ["--model_args", model_args, "--tasks", TASK, "--include_path", str(TASK_DIR)]
    cmd += ["--limit", str(LIMIT), "--output_path", str(out), "--log_samples"]
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(out / "hf"),  # the datasets cache, away from the user's
        TOKENIZERS_PARALLELISM="false",
    )
    # cwd: the task's data_files path is relative to it.
    proc = subprocess.run(cmd, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"lm_eval failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (results_file,) = out.rglob("results_*.json")
    (samples_file,) = out.rglob(f"samples_{TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines() if line]
    return {"results": json.loads(results_file.read_text()), "samples": samples}


def _fake_loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
    """The fake engine's rule (tests/fake_engine.py `fake_prompt_logprobs`) summed over the
    continuation's tokens (one per byte): token t at position j has -0.25 * (1 + (t + j) % 4)
    and is the top token when t + j is even."""
    ids = list((context + continuation).encode())
    start = len(context.encode())
    total = sum(-0.25 * (1 + (ids[j] + j) % 4) for j in range(start, len(ids)))
    greedy = all((ids[j] + j) % 2 == 0 for j in range(start, len(ids)))
    return total, greedy


def test_lm_eval_against_the_fake_engine(tmp_path: Path) -> None:
    with fake_server(max_model_len=256) as srv:
        run = _run_lm_eval(srv, "SmolLM2-135M-Instruct", tmp_path)
        echo_requests = [r for r in srv.added() if r.sampling.prompt_logprobs == 1]
    acc = run["results"]["results"][TASK]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert len(run["samples"]) == LIMIT
    docs = [json.loads(line) for line in (TASK_DIR / f"{TASK}.jsonl").read_text().splitlines()]
    for sample in run["samples"]:
        doc = docs[sample["doc_id"]]
        context = f"Question: {doc['question']}\nAnswer:"
        # The samples file writes each (loglikelihood, is_greedy) pair as strings.
        got = [(float(r[0][0]), str(r[0][1]) == "True") for r in sample["resps"]]
        expected = [_fake_loglikelihood(context, " " + c) for c in doc["choices"]]
        assert [g[0] for g in got] == pytest.approx([e[0] for e in expected])
        assert [g[1] for g in got] == [e[1] for e in expected]
    assert len(echo_requests) == 3 * LIMIT  # one per (question, choice)
    assert all(r.sampling.max_tokens == 1 for r in echo_requests)


@pytest.fixture(scope="module")
def real_server() -> ServerThread:
    with running_server(None, model="random:tiny", cpu_kv_cache_gb=0.05) as srv:
        yield srv


def test_real_engine_returns_prompt_logprobs(real_server: ServerThread) -> None:
    """echo + logprobs on the real engine: one logprob per prompt token but the first."""
    body = {"prompt": "Hello there", "echo": True, "logprobs": 1, "max_tokens": 1}
    r = httpx.post(f"{real_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None
    assert all(v is not None and v <= 0.0 for v in lp["token_logprobs"][1:])
    assert len(lp["tokens"]) >= 3  # the prompt's tokens and the one generated


def test_lm_eval_against_the_real_engine(real_server: ServerThread, tmp_path: Path) -> None:
    run = _run_lm_eval(real_server, "random:tiny", tmp_path)
    assert 0.0 <= run["results"]["results"][TASK]["acc,none"] <= 1.0
    assert len(run["samples"]) == LIMIT
    for sample in run["samples"]:
        assert all(float(r[0][0]) < 0.0 for r in sample["resps"])  # probabilities below 1
