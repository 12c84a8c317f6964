"""Same weights, same answers: greedy completions and label probabilities from Greenlane and
vLLM serving the same exported folder (bench/peer/export_hf.py). Exit 1 on a real mismatch.

    python -m bench.peer.same_answers --greenlane URL --vllm URL --tokenizer FOLDER --out JSON

Prompts go as token ids (no template or special-token differences). vLLM must run with
`--return-tokens-as-token-ids` (its logprobs then name token ids). Checks:
  1. greedy: for each prompt, MAX_TOKENS tokens at temperature 0 (ignore_eos), chosen-token
     logprobs. Token i matches when vLLM's id decodes to Greenlane's token text and the two
     logprobs are within --tol. The exported tokenizer is padded to the model's rows, so both
     servers sample among the same ids and every id has text (an unpadded export would leave
     ids without text, and Greenlane would sample only among the tokenizer's ids). A
     first difference where Greenlane ranks vLLM's token within --tie-tol of its own pick is a
     near tie (bf16 kernels differ): reported, not a failure; the rest of that prompt is skipped.
  2. scoring: P(label | prompt) for label ids spread over the whole vocabulary (also past the
     tokenizer's), apply_softmax false, Greenlane's /v1/score vs vLLM's /generative_scoring
     (which returns the first label's probability): relative difference within --score-rtol.
  3. merged steps (Greenlane only): the prompts again, all at once, while background streams
     decode, so their prefills share steps with the decodes (a merged step of mostly one-token
     rows: FlashInfer's FA2 kernels). Their greedy tokens must equal check 1's up to a near tie,
     and Greenlane's step trace must show such steps (else the check says it checked nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is 12 times 7?\nA:",
]


def model_id(client: httpx.Client, url: str) -> str:
    return client.get(f"{url}/v1/models").json()["data"][0]["id"]


def complete(client: httpx.Client, url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model_id(client, url),
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 5,
        "ignore_eos": True,
    }
    resp = client.post(f"{url}/v1/completions", json=body)
    resp.raise_for_status()
    lp = resp.json()["choices"][0]["logprobs"]
    return {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"], "top": lp["top_logprobs"]}


def vllm_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise SystemExit("vLLM must run with --return-tokens-as-token-ids")
    return int(token.removeprefix("token_id:"))


def _first_difference(
    ref: dict[str, Any], texts: list[str], logprobs: list[float], tol: float, tie_tol: float
) -> tuple[int, float, float | None, bool]:
    """Walk `texts`/`logprobs` against the reference answer `ref` (Greenlane's: token texts,
    logprobs, top-5 by text): (index of the first token that differs in text or by more than
    `tol` in logprob, else the common length; the largest logprob difference before it;
    `ref`'s logprob gap to the other pick there when that pick is in its top-5; whether that
    gap is a near tie, i.e. within `tie_tol` for a different token)."""
    n = min(len(ref["tokens"]), len(texts))
    max_diff = 0.0
    for i in range(n):
        diff = abs(ref["logprobs"][i] - logprobs[i])
        if texts[i] == ref["tokens"][i] and diff <= tol:
            max_diff = max(max_diff, diff)
            continue
        alt = (ref["top"][i] or {}).get(texts[i])
        gap = None if alt is None else ref["logprobs"][i] - alt
        tie = gap is not None and gap <= tie_tol and texts[i] != ref["tokens"][i]
        return i, max_diff, gap, tie
    return n, max_diff, None, False


def compare_greedy(
    tok: Tokenizer, gl: dict[str, Any], vl: dict[str, Any], tol: float, tie_tol: float
) -> dict[str, Any]:
    """One prompt: matched tokens, max logprob difference, and the first difference (if any)."""
    n = min(len(gl["tokens"]), len(vl["tokens"]))
    vids = [vllm_id(t) for t in vl["tokens"][:n]]
    vtexts = [tok.decode([v], skip_special_tokens=False) for v in vids]
    i, max_diff, gap, tie = _first_difference(gl, vtexts, vl["logprobs"][:n], tol, tie_tol)
    if i < n:
        return {
            "matched": i,
            "of": n,
            "max_logprob_diff": max_diff,
            "first_difference": {
                "position": i,
                "greenlane": {"text": gl["tokens"][i], "logprob": gl["logprobs"][i]},
                "vllm": {"id": vids[i], "text": vtexts[i], "logprob": vl["logprobs"][i]},
                "greenlane_gap_to_vllm_pick": gap,
            },
            "near_tie": tie,
            "ok": tie,
        }
    ok = len(gl["tokens"]) == len(vl["tokens"])
    return {"matched": n, "of": n, "max_logprob_diff": max_diff, "near_tie": False, "ok": ok}


def compare_own(
    solo: dict[str, Any], together: dict[str, Any], tol: float, tie_tol: float
) -> dict[str, Any]:
    """Greenlane against itself (token texts): `together` ran beside other streams, `solo`
    alone. Matched tokens, and at the first difference whether `solo` ranked the other pick
    within `tie_tol` of its own (a bf16 near tie: batch shapes change the GEMMs' rounding)."""
    n = min(len(solo["tokens"]), len(together["tokens"]))
    i, _, gap, tie = _first_difference(
        solo, together["tokens"][:n], together["logprobs"][:n], tol, tie_tol
    )
    if i < n:
        where = {"position": i, "solo": solo["tokens"][i], "together": together["tokens"][i]}
        return {"matched": i, "of": n, "near_tie": tie, "ok": tie,
                "first_difference": {**where, "gap": gap}}  # fmt: skip
    return {"matched": n, "of": n, "near_tie": False, "ok": len(solo["tokens"]) == n}


def merged_steps_check(
    client: httpx.Client,
    url: str,
    prompts: list[list[int]],
    solo: list[dict[str, Any]],
    max_tokens: int,
    tol: float,
    tie_tol: float,
    num_background: int = 8,
    background_tokens: int = 256,
    delay_s: float = 0.2,
) -> dict[str, Any]:
    """Check 3 (module docstring): `prompts` at once while `num_background` streams of random
    ids decode; each result against `solo` (the same prompt alone). Also counts, from
    /admin/api/steps, the steps that prefilled beside more decodes than prefill parts."""
    rng = random.Random(7)
    background = [[rng.randrange(1000, 30000) for _ in range(64)] for _ in range(num_background)]
    results: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    start = time.monotonic()

    def run(key: int, ids: list[int], n: int) -> None:
        try:
            results[key] = complete(client, url, ids, n)
        except Exception as exc:  # noqa: BLE001 - reported as the check's failure
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    threads = [
        threading.Thread(target=run, args=(-1 - i, ids, background_tokens))
        for i, ids in enumerate(background)
    ]
    for t in threads:
        t.start()
    # The background streams are decoding by then (64-token prompts) and go on for
    # `background_tokens` steps (~1.5 s on the 8B shape), beside the prompts' prefills.
    time.sleep(delay_s)
    late = [
        threading.Thread(target=run, args=(i, ids, max_tokens)) for i, ids in enumerate(prompts)
    ]
    for t in late:
        t.start()
    for t in threads + late:
        t.join()
    out: dict[str, Any] = {"errors": errors, "prompts": []}
    ok = not errors
    for i, ref in enumerate(solo):
        if i not in results:
            ok = False
            continue
        r = compare_own(ref, results[i], tol, tie_tol)
        out["prompts"].append(r)
        ok &= r["ok"]
    window_s = time.monotonic() - start + 1.0
    try:
        steps = client.get(f"{url}/admin/api/steps", params={"limit": 4096}).json()["steps"]
        recent = [st for st in steps if st.get("age_s", 1e9) <= window_s]
        mostly_decodes = [
            st for st in recent
            if st["num_prefill_tokens"] and st["num_decodes"] > st["num_prefill_seqs"]
        ]  # fmt: skip
        out["steps"] = {
            "in_window": len(recent),
            "prefill_beside_more_decodes": len(mostly_decodes),
        }
        if not mostly_decodes:
            ok = False
            out["steps"]["note"] = "no step prefilled beside more decodes: nothing was checked"
    except Exception as exc:  # noqa: BLE001 - without the trace the check cannot say it ran
        ok = False
        out["steps"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    out["ok"] = ok
    return out


def score_probs(
    client: httpx.Client, gl_url: str, vl_url: str, ids: list[int], label: int
) -> tuple[float, float]:
    body = {"query": ids[:-1], "items": [ids[-1:]], "label_token_ids": [label]}
    body["apply_softmax"] = False
    g = client.post(f"{gl_url}/v1/score", json={"model": model_id(client, gl_url), **body})
    g.raise_for_status()
    v = client.post(
        f"{vl_url}/generative_scoring", json={"model": model_id(client, vl_url), **body}
    )
    v.raise_for_status()
    return float(g.json()["scores"][0][0]), float(v.json()["data"][0]["score"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peer.same_answers")
    p.add_argument("--greenlane", required=True)
    p.add_argument("--vllm", required=True)
    p.add_argument("--tokenizer", required=True, type=Path, help="the exported model folder")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tol", type=float, default=0.15, help="chosen-token logprob tolerance")
    p.add_argument("--tie-tol", type=float, default=0.15, help="near-tie gap (nats)")
    p.add_argument("--score-rtol", type=float, default=0.1)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    report: dict[str, Any] = {"greedy": [], "scores": []}
    ok = True
    solo: list[dict[str, Any]] = []  # Greenlane's answers, one prompt at a time (check 3)
    with httpx.Client(timeout=120.0) as client:
        for text in PROMPTS:
            ids = tok.encode(text, add_special_tokens=False).ids
            gl = complete(client, args.greenlane.rstrip("/"), ids, args.max_tokens)
            solo.append(gl)
            vl = complete(client, args.vllm.rstrip("/"), ids, args.max_tokens)
            r = compare_greedy(tok, gl, vl, args.tol, args.tie_tol)
            r["prompt"] = text
            report["greedy"].append(r)
            ok &= r["ok"]
            print(
                f"greedy {r['matched']}/{r['of']} tokens, max logprob diff "
                f"{r['max_logprob_diff']:.3f}{' (then a near tie)' if r['near_tie'] else ''}"
                f"{'' if r['ok'] else ' MISMATCH'}: {text[:40]!r}",
                flush=True,
            )
        ids = tok.encode(PROMPTS[0], add_special_tokens=False).ids
        # Label ids across the model's rows: SmolLM2's own (< 49,152) and, with the exported
        # tokenizer padded, placeholders past it (every random preset has >= 128,256 rows).
        for label in (13, 1000, 49_151, 50_152, 100_000):
            try:
                g, v = score_probs(
                    client, args.greenlane.rstrip("/"), args.vllm.rstrip("/"), ids, label
                )
            except httpx.HTTPStatusError as exc:  # a label past the model's vocabulary
                report["scores"].append({"label": label, "error": str(exc)[:200]})
                continue
            rel = abs(g - v) / max(g, v, 1e-30)
            good = rel <= args.score_rtol or (math.isfinite(g) and max(g, v) < 1e-12)
            ok &= good
            report["scores"].append({"label": label, "greenlane": g, "vllm": v, "rel_diff": rel})
            print(
                f"P(label {label}): greenlane {g:.4g}, vllm {v:.4g}, rel diff {rel:.3g}"
                f"{'' if good else ' MISMATCH'}",
                flush=True,
            )
        merged = merged_steps_check(
            client,
            args.greenlane.rstrip("/"),
            [tok.encode(t, add_special_tokens=False).ids for t in PROMPTS],
            solo,
            args.max_tokens,
            args.tol,
            args.tie_tol,
        )
        report["merged_steps"] = merged
        ok &= merged["ok"]
        print(
            "merged steps: "
            + ", ".join(
                f"{r['matched']}/{r['of']}" + (" (tie)" if r["near_tie"] else "")
                for r in merged["prompts"]
            )  # fmt: skip
            + f"; steps {merged.get('steps')}{'' if merged['ok'] else ' MISMATCH'}",
            flush=True,
        )
    report["ok"] = ok
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("same answers" if ok else "DIFFERENT ANSWERS", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
