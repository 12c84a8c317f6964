"""The fused decode at 2..64 rows on tensor cores against the unfused graph decode
(diagnostic for issue 12, GPU, engine level: not a headline; the HTTP A/B is
`bash bench/gpu_decode.sh wide REV`).

Part 1, `sweep`: each tensor-core projection kernel of runtime/model/decode_kernels.py (o and
down split-K, gate_up + SiLU, qkv + RoPE + K/V write) over its tiles, on the Qwen2.5-3B and
Llama-3.1-8B shapes at M rows: GB/s of weight bytes read (8 distinct weights in one CUDA
graph, so the L2 holds none of them), next to cuBLAS's `F.linear` on the same shapes (qkv:
the bare projection). The best tile per (kernel, padded rows) is the one with the highest
sum over both shapes of its GB/s as a share of that shape's best (`best_tiles`, the form of
`decode_kernels.TILES`), so the 8B's larger GB/s do not outvote the 3B.

Part 2, `step`: per config preset:batch:context, the decode step (layers + LM head) captured
as the engine captures it (`DecodeGraphs`, one batch size), unfused (FlashInfer + cuBLAS)
against fused with the default tiles and with the sweep's best: each checked against the eager
forward, timed (median of 20 replays) against its bandwidth floor (weights + KV bytes over the
copy bandwidth measured in the same run), its kernels and the gaps between them profiled.
Random weights, KV blocks at random places in the pool.

    python3 -m bench.wide_decode --out $OUT/wide-decode.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from datetime import UTC, datetime
from typing import Any

from bench.bursts import git_revision

DEFAULT_CONFIGS = "qwen2.5-3b:48:640,llama-3.1-8b:16:2048,llama-3.1-8b:64:2048,llama-3.1-8b:4:2048"
NUM_WEIGHTS = 8


def _gemm_tiles(bm: int) -> list[tuple[int, ...]]:
    """(BLOCK_N, BLOCK_K, warps, splits, stages) candidates whose pipeline fits shared memory."""
    out = []
    for bn in (32, 64, 128):
        for bk in (64, 128, 256):
            stages = 4 if (bn + bm) * bk * 2 * 4 <= 160_000 else 3
            out.append((bn, bk, 4, 0, stages))
    return out


def _pair_tiles(bm: int, rows: tuple[int, ...], two: bool) -> list[tuple[int, ...]]:
    """(rows per program, BLOCK_K, warps, stages) candidates whose pipeline fits shared memory;
    `two`: two weight tiles a step. Deeper pipelines and 8 warps too: the first sweep
    (3 stages, 4 warps only) left qkv on the 3B shape at 0.6-0.75x cuBLAS's bandwidth, with
    few programs each streaming a long K (more bytes in flight a program is the lever)."""
    out = []
    for r in rows:
        for bk in (64, 128, 256):
            for stages in (3, 4, 5):
                smem = ((2 if two else 1) * r + bm) * bk * 2 * stages
                if smem > 180_000:
                    continue
                out.append((r, bk, 4, stages))
                if r >= 32:  # 8 warps need a tile of at least 32 x BLOCK_M rows to share
                    out.append((r, bk, 8, stages))
    return out


def _time_kernel(
    kind: str, ws: list[Any], M: int, qkv_args: dict[str, Any], stream: Any
) -> dict[str, Any]:
    """One (kernel, rows) point of the sweep: cuBLAS and every candidate tile, GB/s."""
    import torch
    import torch.nn.functional as F

    from bench.gpu_suite import _graph_ms
    from runtime.model import decode_kernels as dk

    n, k = ws[0].shape
    nbytes = len(ws) * n * k * 2
    bm = dk.block_m(M)
    x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    if kind in ("o", "down"):
        tiles = _gemm_tiles(bm)

        def call(w: Any, t: tuple[int, ...]) -> Any:
            return dk.gemv_splitk(x, w, tile=t, kind=kind)
    elif kind == "gate_up":
        tiles = _pair_tiles(bm, (32, 64, 128), two=True)

        def call(w: Any, t: tuple[int, ...]) -> Any:
            return dk.gate_up_silu(x, w, tile=t)
    else:
        tiles = _pair_tiles(bm, (16, 32, 64), two=True)
        a = qkv_args
        pos = torch.randint(0, 4096, (M,), device="cuda")
        slots = torch.randperm(a["kf"].shape[0], device="cuda")[:M]

        def call(w: Any, t: tuple[int, ...]) -> Any:
            return dk.qkv_rope_write(
                x, w, None, pos, a["cs"], a["kf"], a["vf"], slots, a["hq"], tile=t
            )

    def gbs(fn: Any) -> float:
        ms = _graph_ms(lambda: [fn(w) for w in ws], stream)
        return nbytes / ms / 1e6

    row: dict[str, Any] = {"cublas_gbs": gbs(lambda w: F.linear(x, w))}
    timed: list[tuple[float, tuple[int, ...]]] = []

    def try_tile(t: tuple[int, ...]) -> None:
        try:
            timed.append((gbs(lambda w: call(w, t)), t))
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit is skipped
            row[f"error_{t}"] = f"{type(exc).__name__}: {exc}"[:160]

    for t in tiles:
        try_tile(t)
    if kind in ("o", "down") and timed:  # K splits for the three best
        timed.sort(key=lambda r: -r[0])
        for _, t in timed[:3]:
            for sp in (1, 2, 4, 8):
                try_tile((*t[:3], sp, t[4]))
    timed.sort(key=lambda r: -r[0])
    default = dk.TILES[kind][bm]
    row["default_tile"] = list(default)
    row["default_gbs"] = next((g for g, t in timed if t == default), None)
    row["top"] = [{"gbs": round(g, 1), "tile": list(t)} for g, t in timed[:5]]
    row["all"] = [(round(g, 1), list(t)) for g, t in timed]
    return row


def sweep(presets: list[str], rows_list: list[int], stream: Any) -> dict[str, Any]:
    """Part 1 (see the module doc): per preset, kernel and rows, then `best_tiles`."""
    import torch

    from runtime.model import decode_kernels as dk
    from runtime.model.ops import rope_cos_sin_cache
    from runtime.model.presets import get_preset

    out: dict[str, Any] = {}
    score: dict[tuple[str, int, tuple[int, ...]], float] = {}  # (kind, bm, tile) -> sum GB/s
    for preset in presets:
        cfg = get_preset(preset)
        hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        kf = torch.randn(4096 * 16, hkv, d, device="cuda", dtype=torch.bfloat16)
        qkv_args = {
            "kf": kf,
            "vf": torch.randn_like(kf),
            "cs": rope_cos_sin_cache(8192, d, 500000.0, None, "cuda"),
            "hq": hq,
        }
        H, inter = cfg.hidden_size, cfg.intermediate_size
        shapes = {
            "o": (H, hq * d),
            "down": (H, inter),
            "gate_up": (2 * inter, H),
            "qkv": ((hq + 2 * hkv) * d, H),
        }
        for kind, (n, k) in shapes.items():
            ws = [
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                for _ in range(NUM_WEIGHTS)
            ]
            for M in rows_list:
                key = f"{preset}_m{M}_{kind}"
                row = _time_kernel(kind, ws, M, qkv_args, stream)
                out[key] = row
                bm = dk.block_m(M)
                timed = row.pop("all")
                top = timed[0][0] if timed else 1.0
                for g, t in timed:  # each shape's share of its own best, summed over shapes
                    score[(kind, bm, tuple(t))] = score.get((kind, bm, tuple(t)), 0.0) + g / top
                print(
                    f"sweep {key}: cublas {row['cublas_gbs']:.0f} GB/s, default "
                    f"{row['default_gbs']}, top {row['top'][:2]}",
                    flush=True,
                )
            del ws
            torch.cuda.empty_cache()
        qkv_args.clear()
        torch.cuda.empty_cache()
    best: dict[str, dict[int, list[int]]] = {}
    for (kind, bm, t), total in score.items():
        cur = best.setdefault(kind, {}).get(bm)
        if cur is None or total > score[(kind, bm, tuple(cur))]:
            best[kind][bm] = list(t)
    out["best_tiles"] = best
    return out


def step(
    preset: str, B: int, ctx: int, copy_gbs: float, best: dict[str, dict[int, list[int]]]
) -> dict[str, Any]:
    """One config: unfused vs fused (default tiles, then `best`) decode graph steps."""
    import torch

    from bench.gpu_suite import _batch, _graph_decode_step, _preset_model, _weight_bytes
    from runtime.attention.flashinfer_backend import FlashInferBackend
    from runtime.graphs.decode import DecodeGraphs
    from runtime.model import decode_kernels as dk

    blocks_per_seq = -(-(ctx + 1) // 16)
    num_blocks = B * blocks_per_seq + 64
    model, cfg, pool = _preset_model(preset, num_blocks)
    be = FlashInferBackend.from_pool(pool, cfg.num_q_heads)
    w_bytes = _weight_bytes(model)
    kv_bytes = B * ctx * cfg.num_layers * 2 * cfg.kv_size * 2
    perm = torch.randperm(num_blocks - 8).tolist()
    blocks = [perm[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(B)]
    b = _batch([(ctx, 1, ctx + 1)] * B, blocks, is_decode=True)
    s = torch.cuda.Stream()
    r: dict[str, Any] = {"weight_bytes": w_bytes, "kv_bytes": kv_bytes}
    default_tiles = {k: dict(v) for k, v in dk.TILES.items()}
    variants: list[tuple[str, int, dict | None]] = [("unfused", 0, None), ("fused", 64, None)]
    if best:
        variants.append(("fused_best", 64, best))
    keep = (
        "graph_step_ms",
        "floor_ms",
        "rel_err_vs_eager",
        "over_floor",
        "kernels_per_step",
        "kernel_ms_per_step",
        "gaps_ms",
        "ms_by_kind",
        "top_kernels",
        "profile_error",
    )
    logits: dict[str, Any] = {}
    with torch.inference_mode():
        for label, fused_max, tiles in variants:
            dk.TILES.update({k: dict(v) for k, v in default_tiles.items()})
            for kind, by_bm in (tiles or {}).items():
                for bm, t in by_bm.items():
                    dk.TILES[kind][int(bm)] = tuple(t)
            try:
                graphs = DecodeGraphs(
                    model,
                    pool.k,
                    pool.v,
                    s,
                    pad_block_id=num_blocks - 1,
                    max_blocks_per_seq=blocks_per_seq + 1,
                    batch_sizes=(B,),
                    fused_max_batch=fused_max,
                )
                t0 = time.perf_counter()
                graphs.capture()
                capture_s = time.perf_counter() - t0
                v = _graph_decode_step(
                    model,
                    be,
                    graphs,
                    s,
                    b,
                    f"wide {preset} b{B} {label}",
                    w_bytes + kv_bytes,
                    copy_gbs,
                    top=12,
                    by_kind=True,
                )
                r[label] = {k: v[k] for k in keep if k in v}
                r[label]["capture_s"] = capture_s
                with torch.cuda.stream(s):
                    logits[label] = model.compute_logits(graphs.run(b)).float().cpu()
                s.synchronize()
                r[label]["fused_errors"] = {str(k): e for k, e in graphs.fused_errors.items()}
                graphs.graphs.clear()
            except Exception as exc:  # noqa: BLE001 - one variant's failure keeps the rest
                traceback.print_exc()
                r[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"step {preset} b{B} ctx{ctx} {label}: {json.dumps(r[label])[:400]}", flush=True)
            torch.cuda.empty_cache()
    dk.TILES.update(default_tiles)
    try:
        with torch.inference_mode():
            _vs_fp32(r, model, cfg, pool, b, logits, f"wide {preset} b{B}")
    except Exception as exc:  # noqa: BLE001 - the timings above are kept
        traceback.print_exc()
        r["fp32_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for label in ("fused", "fused_best"):
        u, f = r.get("unfused", {}), r.get(label, {})
        if "graph_step_ms" in u and "graph_step_ms" in f:
            r[f"{label}_speedup"] = u["graph_step_ms"] / f["graph_step_ms"]
    return r


def _vs_fp32(r: dict, model: Any, cfg: Any, pool: Any, b: Any, logits: dict, name: str) -> None:
    """Each variant's logits against a float32 forward of the same weights and pool. Fused and
    unfused bf16 paths round differently (their logits differ by about as much as each differs
    from fp32, ~5e-2 on these random-weight models), so the fused one is judged by its
    distance to the exact answer next to the unfused one's."""
    from bench.gpu_suite import check_no_worse_than_unfused, fp32_reference_logits, rel_err

    ref = fp32_reference_logits(model, cfg, pool, {0: b})[0]
    errs = {label: rel_err(lg, ref) for label, lg in logits.items()}
    for label, e in errs.items():
        r.setdefault(label, {})["rel_err_vs_fp32"] = e
        r[label]["argmax_same_as_fp32"] = float(
            (logits[label].argmax(-1) == ref.argmax(-1)).float().mean()
        )
    check_no_worse_than_unfused(errs, lambda label: f"{name} {label}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="preset:batch:context,...")
    ap.add_argument("--sweep-rows", default="16,32,48", help="rows the tile sweep times")
    ap.add_argument("--sweep-presets", default="qwen2.5-3b,llama-3.1-8b")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from bench.gpu_suite import RESULTS, _free, section_ceilings
    from runtime.model import ops

    ops.use_flashinfer(True)
    t0 = time.time()
    res: dict[str, Any] = {
        "command": "python3 -m bench.wide_decode " + " ".join(argv or []),
        "revision": git_revision(),
        "device": torch.cuda.get_device_name(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "note": "engine-level diagnostic (no server): graph step vs its floor, not a headline",
    }
    res["ceilings"] = section_ceilings()
    copy_gbs = res["ceilings"]["copy_gbs_read_plus_write"]

    def save() -> None:
        res["checks"] = RESULTS["checks"]
        res["elapsed_s"] = round(time.time() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    best: dict[str, Any] = {}
    if not args.no_sweep:
        s = torch.cuda.Stream()
        try:
            with torch.inference_mode():
                res["sweep"] = sweep(
                    args.sweep_presets.split(","), [int(x) for x in args.sweep_rows.split(",")], s
                )
            best = res["sweep"]["best_tiles"]
        except Exception as exc:  # noqa: BLE001 - the steps still run on the default tiles
            traceback.print_exc()
            res["sweep_error"] = f"{type(exc).__name__}: {exc}"[:300]
        save()
        _free()
    res["steps"] = {}
    for item in args.configs.split(","):
        preset, b_s, c_s = item.strip().split(":")
        try:
            res["steps"][item] = step(preset, int(b_s), int(c_s), copy_gbs, best)
        except Exception as exc:  # noqa: BLE001 - one config's failure keeps the rest
            traceback.print_exc()
            res["steps"][item] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        save()
        _free()
    for item, r in res["steps"].items():
        parts = [f"{item}:"]
        for label in ("unfused", "fused", "fused_best"):
            v = r.get(label) or {}
            if "graph_step_ms" in v:
                parts.append(
                    f"{label} {v['graph_step_ms']:.3f} ms ({v['over_floor']:.2f}x floor, "
                    f"{v.get('kernels_per_step')} kernels, gaps {v.get('gaps_ms', 0):.2f} ms)"
                )
        print(" ".join(parts), flush=True)
    print(f"checks failed: {[c for c in RESULTS['checks'] if not c['ok']]}")
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
