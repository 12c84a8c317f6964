"""GPU suite: correctness checks and measurements on the H200, in one process per device call.

Run on the device machine through `bash bench/gpu_run.sh --sections smoke,... --rev <git sha>`
(the wrapper installs carried wheels and restores the FlashInfer JIT cache). Every section
appends to one result dict, written as JSON to $OUT (and printed as a short table last).

Sections:
  ceilings   bf16 matmul peak (8192^3, random data) and device-to-device copy bandwidth
  green      SM layout from the driver, pair creation over every split, SM-limit check
  backend    FlashInfer backend vs a float32 reference over the paged pool, all kernel modes,
             pool writes (kept slots written, discarded slots untouched)
  ops        FlashInfer rmsnorm / fused_add_rmsnorm / silu_and_mul / rope vs runtime.ops torch
  kernels    FlashInfer ragged prefill 8k and paged decode b64x2k timings
  profile    cost-model profile: stage latency vs SM split for model-shaped prefill/decode work
             on green streams, alone and concurrent; fit + held-out validation
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

RESULTS: dict[str, Any] = {"sections": {}, "checks": [], "errors": []}


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}", flush=True)
    return ok


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def time_cuda(fn: Callable[[], Any], iters: int = 20, warmup: int = 3,
              stream: torch.cuda.Stream | None = None) -> float:
    """Median milliseconds of fn() with CUDA events on `stream` (current stream if None)."""
    s = stream or torch.cuda.current_stream()
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            fn()
            b.record(s)
            b.synchronize()
            times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


# --------------------------------------------------------------------------- ceilings
def section_ceilings() -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_cuda(lambda: a @ b, iters=30)
    tflops = 2 * n**3 / ms / 1e9
    src = torch.randn(2 << 28, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms_c = time_cuda(lambda: dst.copy_(src), iters=30)
    gbs = 2 * src.numel() * 2 / ms_c / 1e6  # bytes read + written
    return {"matmul_bf16_tflops": tflops, "copy_gbs_read_plus_write": gbs}


# --------------------------------------------------------------------------- green contexts
def section_green() -> dict:
    from runtime import green_ctx

    reason = green_ctx.green_contexts_unavailable_reason()
    if reason:
        check("green contexts available", False, reason)
        return {"unavailable": reason}
    layout = green_ctx.read_sm_layout()
    counts = layout.valid_prefill_counts()
    t0 = time.perf_counter()
    pairs = green_ctx.create_pairs(counts)
    create_ms = (time.perf_counter() - t0) * 1e3
    disjoint = all(p.prefill.sms + p.decode.sms <= layout.total_sms for p in pairs.values())
    check("green pairs created", len(pairs) == len(counts),
          f"{len(pairs)} splits, {create_ms:.1f} ms total")
    check("green pairs disjoint", disjoint)
    # SM limit: one 8192^3 matmul on the small vs the large side of the most uneven pair.
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    per_split = {}
    for sms in (counts[0], counts[len(counts) // 2], counts[-1]):
        p = pairs[sms]
        ms = time_cuda(lambda: a @ b, iters=5, stream=p.prefill.stream)
        per_split[sms] = 2 * n**3 / ms / 1e9
    lo, hi = counts[0], counts[-1]
    check("SM limit holds (matmul scales with SMs)", per_split[hi] > 3 * per_split[lo],
          f"{lo} SMs {per_split[lo]:.0f} TF/s, {hi} SMs {per_split[hi]:.0f} TF/s")
    return {
        "total_sms": layout.total_sms, "min_partition_sms": layout.min_partition_sms,
        "alignment_sms": layout.alignment_sms, "splits": counts,
        "decode_sms": {k: p.decode.sms for k, p in pairs.items()},
        "create_all_ms": create_ms, "matmul_tflops_on_prefill_side": per_split,
    }


# --------------------------------------------------------------------------- backend
def _ref_attention(q, k_new, v_new, k_pool, v_pool, seqs, block_size, scale):
    """float32 reference: per sequence, keys = [context from the pool | this step's k]."""
    out = torch.empty_like(q, dtype=torch.float32)
    Hq, Hkv = q.shape[1], k_new.shape[1]
    for s in seqs:
        ctx, nq = s.num_context_tokens, s.num_query_tokens
        rows = slice(s.query_start, s.query_start + nq)
        pos = torch.arange(ctx, device=q.device)
        blocks = torch.tensor(s.block_ids, device=q.device)[pos // block_size] if ctx else pos
        kc = k_pool[blocks, pos % block_size] if ctx else k_new[:0]
        vc = v_pool[blocks, pos % block_size] if ctx else v_new[:0]
        K = torch.cat([kc, k_new[rows]]).float().repeat_interleave(Hq // Hkv, dim=1)
        V = torch.cat([vc, v_new[rows]]).float().repeat_interleave(Hq // Hkv, dim=1)
        Q = q[rows].float()
        att = torch.einsum("qhd,khd->hqk", Q, K) * scale
        qpos = ctx + torch.arange(nq, device=q.device)
        kpos = torch.arange(ctx + nq, device=q.device)
        att.masked_fill_(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", att.softmax(-1), V)
    return out


def _make_seqs(specs, block_size, num_blocks, gen):
    """specs: (ctx, nq, kept) -> SeqSlice list with random distinct blocks."""
    from runtime.attention.base import SeqSlice

    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, start = [], 0
    for ctx, nq, kept in specs:
        nb = (max(kept, ctx) + block_size - 1) // block_size
        ids, perm = perm[:nb], perm[nb:]
        seqs.append(SeqSlice(start, nq, ctx, kept, ids))
        start += nq
    return seqs


def section_backend() -> dict:
    from runtime.attention.base import ForwardBatch
    from runtime.attention.flashinfer_backend import FlashInferBackend

    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    cases = {
        # name: (Hq, Hkv, D, specs, is_decode)
        "ragged_fresh": (32, 8, 128, [(0, 300, 300), (0, 77, 77), (0, 1024, 1024)], False),
        "ragged_discard": (32, 8, 128, [(0, 300, 288), (0, 50, 48), (0, 700, 0)], False),
        "paged_prefix_hit": (32, 8, 128, [(512, 100, 612), (0, 64, 64), (33, 7, 40)], False),
        "gather_hit_discard": (16, 2, 128, [(256, 200, 448), (64, 31, 64), (0, 40, 32)], False),
        "decode_tc_gqa4": (32, 8, 128, [(c, 1, c + 1) for c in (5, 16, 700, 2047, 1)], True),
        "decode_gqa3_d64": (9, 3, 64, [(c, 1, c + 1) for c in (3, 31, 400)], True),
        "decode_gqa8_qwen": (16, 2, 128, [(c, 1, c + 1) for c in (15, 1000)], True),
    }
    bs, nblocks, layers = 16, 512, 2
    for name, (Hq, Hkv, D, specs, is_decode) in cases.items():
        try:
            kc = [torch.randn(nblocks, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
                  for _ in range(layers)]
            vc = [torch.randn_like(kc[0]) for _ in range(layers)]
            be = FlashInferBackend(kc, vc, Hq, Hkv, D)
            seqs = _make_seqs(specs, bs, nblocks, gen)
            T = sum(s.num_query_tokens for s in seqs)
            batch = ForwardBatch(
                input_ids=torch.zeros(T, dtype=torch.int64, device="cuda"),
                positions=torch.zeros(T, dtype=torch.int64, device="cuda"),
                seqs=seqs, logits_indices=torch.zeros(1, dtype=torch.int64, device="cuda"),
                is_decode=is_decode,
            )
            be.plan(batch)
            worst = 0.0
            for layer in range(layers):
                q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16)
                k_before, v_before = kc[layer].clone(), vc[layer].clone()
                o = be.forward(layer, q, k, v)
                ref = _ref_attention(q, k, v, k_before, v_before, seqs, bs, D**-0.5)
                worst = max(worst, rel_err(o, ref))
                # Pool: kept new positions hold k; everything else unchanged.
                expect = k_before.clone()
                for s in seqs:
                    for i in range(s.num_kept_tokens - s.num_context_tokens):
                        p = s.num_context_tokens + i
                        expect[s.block_ids[p // bs], p % bs] = k[s.query_start + i]
                pool_ok = torch.equal(expect, kc[layer])
                check(f"backend {name} layer{layer} pool writes", pool_ok)
            check(f"backend {name} vs fp32 reference", worst < 2e-2,
                  f"mode={be.debug_state()['mode']} rel_err={worst:.2e}")
            out[name] = {"rel_err": worst, "mode": be.debug_state()["mode"]}
        except Exception as exc:
            traceback.print_exc()
            check(f"backend {name}", False, f"{type(exc).__name__}: {exc}")
    return out


# --------------------------------------------------------------------------- ops
def section_ops() -> dict:
    from runtime import ops

    out = {}
    T, H, inter = 1000, 4096, 14336
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(T, 2 * inter, device="cuda", dtype=torch.bfloat16)
    cache = ops.rope_cos_sin_cache(8192, 128, 500000.0, None, device="cuda")
    pos = torch.randint(0, 8192, (T,), device="cuda")
    q = torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16)
    res = {}
    for flag in (False, True):
        ops.use_flashinfer(flag)
        n1 = ops.rms_norm(x, w, 1e-5)
        n2, r2 = ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
        s1 = ops.silu_and_mul(g)
        q1, k1 = ops.apply_rope(q, k, pos, cache)
        res[flag] = (n1, n2, r2, s1, q1, k1)
    ops.use_flashinfer(False)
    names = ["rmsnorm", "fused_add_rmsnorm", "fused_add_residual", "silu_and_mul", "rope_q",
             "rope_k"]
    for i, nm in enumerate(names):
        e = rel_err(res[True][i], res[False][i])
        out[nm] = e
        check(f"ops {nm} flashinfer vs torch", e < 1e-2, f"rel_err={e:.2e}")
    return out


# --------------------------------------------------------------------------- kernels
def section_kernels() -> dict:
    import flashinfer

    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    out = {}
    T, Hq, Hkv, D = 8192, 32, 8, 128
    q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    rag = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    ind = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    rag.plan(ind, ind, Hq, Hkv, D, causal=True, q_data_type=torch.bfloat16)
    ms = time_cuda(lambda: rag.run(q, k, v))
    out["ragged_prefill_8k_ms"] = ms
    out["ragged_prefill_8k_tflops"] = 4 * T * T / 2 * Hq * D / ms / 1e9
    B, ctx, bs = 64, 2048, 16
    pages = B * ctx // bs
    kc = torch.randn(pages, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    indptr = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * (ctx // bs)
    idx = torch.randperm(pages, device="cuda").int()
    last = torch.full((B,), bs, dtype=torch.int32, device="cuda")
    dec.plan(indptr, idx, last, Hq, Hkv, D, bs, q_data_type=torch.bfloat16)
    qd = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    ms = time_cuda(lambda: dec.run(qd, (kc, vc)))
    out["decode_b64_2k_ms"] = ms
    out["decode_b64_2k_kv_gbs"] = 2 * kc.numel() * 2 / ms / 1e6
    return out


SECTIONS: dict[str, Callable[[], dict]] = {
    "ceilings": section_ceilings,
    "green": section_green,
    "backend": section_backend,
    "ops": section_ops,
    "kernels": section_kernels,
}


def _summary_table() -> str:
    lines = ["", "=== GPU suite summary ==="]
    n_ok = sum(c["ok"] for c in RESULTS["checks"])
    lines.append(f"checks: {n_ok}/{len(RESULTS['checks'])} passed")
    for c in RESULTS["checks"]:
        if not c["ok"]:
            lines.append(f"  FAIL {c['name']} {c['detail']}")
    for sec, val in RESULTS["sections"].items():
        if isinstance(val, dict):
            flat = {k: v for k, v in val.items() if isinstance(v, (int, float, str))}
            lines.append(f"{sec}: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in flat.items()))
    for e in RESULTS["errors"]:
        lines.append(f"ERROR {e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="ceilings,green,backend,ops,kernels")
    ap.add_argument("--rev", default="unknown", help="git revision of the tree (pass it in)")
    ap.add_argument("--tag", default="gpu-suite")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to run")
        return 2
    RESULTS.update({
        "command": "bash bench/gpu_run.sh " + " ".join(sys.argv[1:] if argv is None else argv),
        "git_revision": args.rev,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    })
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            RESULTS["sections"][name] = SECTIONS[name]()
        except Exception as exc:
            traceback.print_exc()
            RESULTS["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        print(f"--- section {name} took {time.perf_counter() - t0:.1f} s", flush=True)
    out_dir = os.environ.get("OUT") or "bench/results"
    date = dt.date.today().isoformat()
    path = os.path.join(out_dir, f"{args.tag}-{date}.json")
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    print(_summary_table())
    print(f"wrote {path}")
    return 0 if all(c["ok"] for c in RESULTS["checks"]) and not RESULTS["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
