"""The fused decode attention's KV splits: a fixed split count per batch size against splits
that follow each row's context (`decode_kernels.split_chunk_tokens`). Engine-level diagnostic
(GPU), not a headline: the product check is plan v through HTTP.

Why: plan v's trace (2026-12-06) had the 3B's decode-only steps at 33..63 rows take 11.0-11.7 ms
where FlashInfer's, past 64 rows, took 6.5-8.3: with a 6k-14k context among ~1k ones and two
splits a row, one program held half the long row while an SM's share was under 1k tokens.

For each model shape, batch size and context mix this captures one decode step's attention
(every layer over its own pool, so the L2 holds none of it) into a CUDA graph per variant and
times the replays:
- `fixed`: what ran before, max(1, pow2(ceil(num_sms / (M * Hkv)))) even splits a row;
- `row`: `attention_splits` as the grid's bound and `split_chunk_tokens` per row (the engine's);
- `row-x2`, `row-half`: the same rule with twice and half the bound (is the bound right?).
Contexts (random, seeded): `even` all 2,048; `one-long` one of 14,000 among 500-1,500;
`plan-v` a sixth of the rows at 6k-14k among 200-1,500 (a long chat prompt's decode among
chat streams). Each variant's output is checked against `fixed`'s (rel. error printed).

    python3 -m bench.decode_splits --out $OUT/decode-splits.json
    python3 -m bench.decode_splits --steps A.steps.json [B.steps.json ...]   # served steps

The second form reads served step traces (`bench.gpu_serving`'s *.steps.json) and prints the
decode-only steps' device time by batch size (median, p90, count, context tokens), which is
where the fixed split showed.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

import numpy as np

SHAPES = ("qwen2.5-3b", "llama-3.1-8b")  # presets (runtime/model/presets.py)
PAGE = 16


def contexts(kind: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "even":
        return np.full(rows, 2048, dtype=np.int64)
    if kind == "one-long":
        lens = rng.integers(500, 1501, rows)
        lens[rng.integers(rows)] = 14_000
        return lens.astype(np.int64)
    if kind == "plan-v":
        lens = rng.integers(200, 1501, rows)
        num_long = max(1, rows // 6)
        lens[rng.choice(rows, num_long, replace=False)] = rng.integers(6000, 14_001, num_long)
        return lens.astype(np.int64)
    raise ValueError(kind)


ROW_BUCKETS = ((1, 15), (16, 31), (32, 47), (48, 63), (64, 64), (65, 95), (96, 127))


def decode_steps_by_rows(steps: list[dict]) -> list[dict]:
    """Decode-only steps (no prefill, whole GPU) grouped by row count: device ms median and
    p90, the count, and the median context tokens a step."""
    out = []
    for lo, hi in ROW_BUCKETS:
        sel = [
            s
            for s in steps
            if not s.get("num_prefill_tokens")
            and not s.get("on_split")
            and lo <= s.get("num_decodes", 0) <= hi
            and s.get("device_ms") is not None
        ]
        if not sel:
            continue
        ms = sorted(s["device_ms"] for s in sel)
        ctx = sorted(s.get("decode_context_tokens", 0) for s in sel)
        out.append(
            {
                "rows": f"{lo}-{hi}",
                "steps": len(sel),
                "median_ms": round(ms[len(ms) // 2], 2),
                "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2),
                "median_context_tokens": ctx[len(ctx) // 2],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="the timing's JSON (GPU)")
    ap.add_argument("--steps", nargs="+", help="served step traces to read instead (no GPU)")
    ap.add_argument("--rows", default="16,32,48,64")
    ap.add_argument("--mixes", default="even,one-long,plan-v")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    if args.steps:
        for path in args.steps:
            with open(path) as f:
                rows = decode_steps_by_rows(json.load(f)["steps"])
            print(path)
            for r in rows:
                print("  " + json.dumps(r))
        return
    if not args.out:
        ap.error("--out or --steps")
    _time_splits(args)


def _time_splits(args: argparse.Namespace) -> None:
    import torch

    from bench.bursts import git_revision
    from bench.gpu_suite import _graph_ms, rel_err
    from runtime.model import decode_kernels as dk
    from runtime.model.presets import get_preset

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_list = [int(r) for r in args.rows.split(",")]
    mixes = args.mixes.split(",")
    result: dict[str, Any] = {
        "command": "python3 -m bench.decode_splits "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v and k not in ("out", "steps")),
        "revision": git_revision(),
        "device": torch.cuda.get_device_name(0),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "num_sms": num_sms,
        "kind": "engine-level diagnostic: one decode step's attention, CUDA graph, us",
        "cases": [],
    }
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    batches = {(r, m): contexts(m, r, rng) for r in rows_list for m in mixes}
    # One pool a layer with room for the largest batch (each batch reuses it).
    num_blocks = max(int((-(-lens // PAGE)).sum()) for lens in batches.values())
    for shape in args.shapes.split(","):
        cfg = get_preset(shape)
        hq, hkv, d, layers = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
        kfs = [
            torch.randn(num_blocks * PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(layers)
        ]
        vfs = [torch.randn_like(k) for k in kfs]
        for rows in rows_list:
            for mix in mixes:
                lens = batches[(rows, mix)]
                need = -(-lens // PAGE)
                perm = torch.randperm(num_blocks, device="cuda").int()
                table = torch.zeros(rows, int(need.max()), dtype=torch.int32, device="cuda")
                start = 0
                for i, nb in enumerate(need.tolist()):
                    table[i, :nb] = perm[start : start + nb]
                    start += nb
                lens_t = torch.from_numpy(lens).cuda()
                q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
                # A fixed, zeroed split-counter buffer like FusedDecodeStep's (the kernel
                # leaves it zero): None would put a memset into the graph for every layer.
                counters = torch.zeros(rows, hkv, dtype=torch.int32, device="cuda")
                fixed_s = max(1, min(64, dk._pow2(-(-num_sms // (rows * hkv)))))
                bound = dk.attention_splits(rows, hkv, num_sms)
                variants: dict[str, tuple[int, torch.Tensor | None]] = {"fixed": (fixed_s, None)}
                for name, s in (
                    ("row", bound),
                    ("row-x2", min(64, 2 * bound)),
                    ("row-half", max(1, bound // 2)),
                ):
                    chunk = dk.split_chunk_tokens(lens, hkv, s, num_sms)
                    variants[name] = (s, torch.from_numpy(chunk).cuda())
                kv_bytes = 2 * int(lens.sum()) * hkv * d * 2 * layers
                case: dict[str, Any] = {
                    "shape": shape,
                    "rows": rows,
                    "mix": mix,
                    "tokens": int(lens.sum()),
                    "max_len": int(lens.max()),
                }
                ref = None
                for name, (s, chunk) in variants.items():
                    o = dk.decode_attention(
                        q,
                        kfs[0],
                        vfs[0],
                        table,
                        lens_t,
                        PAGE,
                        d**-0.5,
                        s,
                        chunk_tokens=chunk,
                        counters=counters,
                    )
                    if ref is None:
                        ref = o.float()

                    def step(
                        s=s,
                        chunk=chunk,
                        q=q,
                        table=table,
                        lens_t=lens_t,
                        d=d,
                        kv=(kfs, vfs),
                        cnt=counters,
                    ):
                        for k, v in zip(*kv, strict=True):
                            dk.decode_attention(
                                q,
                                k,
                                v,
                                table,
                                lens_t,
                                PAGE,
                                d**-0.5,
                                s,
                                chunk_tokens=chunk,
                                counters=cnt,
                            )

                    ms = _graph_ms(step, stream)
                    case[name] = {
                        "max_splits": s,
                        "us": round(ms * 1e3, 1),
                        "kv_tbs": round(kv_bytes / ms / 1e9, 2),
                        "rel_err_vs_fixed": rel_err(o.float(), ref),
                    }
                case["row_over_fixed"] = round(case["row"]["us"] / case["fixed"]["us"], 3)
                result["cases"].append(case)
                print(json.dumps(case), flush=True)
        kfs.clear()
        vfs.clear()
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
