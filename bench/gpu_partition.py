"""GPU validation + benchmark of intra-GPU prefill/decode disaggregation (issue 6).

Run on the device machine from the repo root (after bench/gpu_run.sh's wheel install):
    python -m bench.gpu_partition --model random:qwen2.5-3b --out $OUT/partition.json

Sections (each in try/except; its error is recorded in the JSON):
  profile     the engine's own model on its pre-created green pairs: prefill and decode alone
              on the whole GPU and on splits, concurrent prefill + decode per split (speedup
              vs time-slicing the same work: the crossover table); cost-model fit on part of
              the shapes/splits, prediction error (MAPE) on held-out shapes/splits, alone and
              concurrent; controller decisions; calibration saved and installed in the engine
  graphs_split decode CUDA graphs captured per split: selection per stream, graph vs eager
              logits on green streams, decode step eager vs graph at B=16/64 (engine built
              with cuda_graphs=True; `--cuda-graphs` overrides)
  correctness greedy tokens of the same requests in `off` vs a static split (bf16: reported
              as a match fraction)
  serve       in-process load (Poisson arrivals, token-id prompts with the bench workloads'
              length distributions, scaled): `off`, the best static split and `auto` in the
              same process, modes switched with `engine.partition.set_mode`, prefix cache
              reset between runs; TTFT / TBT mean and P99, throughput, SLO attainment
Not the HTTP harness (bench.serve): the device budget allowed one in-process run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS: dict[str, Any] = {"sections": {}, "errors": {}}


def _tok_patch(folder: str) -> None:
    """Random presets load the default model's tokenizer; point it at a carried folder."""
    import runtime.engine
    import runtime.model.loader
    from runtime.tokenizer import Tokenizer

    if Path(folder, "tokenizer.json").is_file():
        runtime.model.loader.load_tokenizer = lambda spec: Tokenizer.from_dir(folder)  # type: ignore[assignment]
        _ = runtime.engine


def time_on(stream: Any, fn: Any, iters: int = 3, warmup: int = 1) -> float:
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
    return float(np.median(ts))


def _batch(specs: list[tuple[int, int, int]], blocks: list[list[int]], is_decode: bool) -> Any:
    from runtime.attention.base import ForwardBatch, SeqSlice

    seqs, start, pos = [], 0, []
    for (ctx, nq, kept), bl in zip(specs, blocks, strict=True):
        seqs.append(SeqSlice(start, nq, ctx, kept, bl))
        pos.extend(range(ctx, ctx + nq))
        start += nq
    ids = torch.randint(100, 40000, (start,), device="cuda")
    last = torch.tensor([s.query_start + s.num_query_tokens - 1 for s in seqs], device="cuda")
    return ForwardBatch(ids, torch.tensor(pos, device="cuda"), seqs, last, is_decode)


# ------------------------------------------------------------------------------------- profile
def section_profile(engine: Any) -> dict:
    from runtime.partition.cost_model import (
        DECODE,
        PREFILL,
        CostModel,
        DecodeShape,
        PrefillShape,
        ProfileSample,
        SplitController,
    )

    g = engine._green
    assert g is not None, "no green-context partition"
    model, runner = engine.model, engine.runner
    be_p, be_d = runner.prefill_backend, runner.decode_backend
    L = engine.model_config.num_layers
    total = g.layout.total_sms
    bs = engine.config.block_size
    nblk = engine.block_manager.num_blocks
    perm = torch.randperm(nblk - 1).tolist()
    fit_splits = [s for s in (32, 64, 96, 112) if s in g.pairs]
    held_splits = [s for s in (48, 80) if s in g.pairs]
    whole = torch.cuda.Stream()
    out: dict[str, Any] = {"total_sms": total, "splits": g.splits, "alone": {}, "concurrent": {}}
    chunk = engine.config.chunk_tokens()

    def pre(T: int, ctx: int = 0) -> tuple[Any, Any]:
        nb = (ctx + T + bs - 1) // bs
        b = _batch([(ctx, T, ctx + T)], [perm[:nb]], False)
        return b, lambda: model(b.input_ids, b.positions, be_p, chunk_tokens=chunk)

    def dec(B: int, ctx: int) -> tuple[Any, Any]:
        per = (ctx + 1 + bs - 1) // bs
        off = 70000 // bs
        blocks = [perm[(off + i * per) % (nblk - per - 1) :][:per] for i in range(B)]
        b = _batch([(ctx, 1, ctx + 1)] * B, blocks, True)
        return b, lambda: model(b.input_ids, b.positions, be_d)

    def pstream(sms: int) -> Any:
        return whole if sms == total else g.pairs[sms].prefill.stream

    def dstream(prefill_sms: int) -> Any:
        return whole if prefill_sms == 0 else g.pairs[prefill_sms].decode.stream

    fit, held = [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for T, ctx in ((2048, 0), (8192, 0), (4096, 4096)):
            b, fn = pre(T, ctx)
            shp = PrefillShape.from_seqs([(ctx, T)], L)
            for sms in [total, *fit_splits, *held_splits]:
                st = pstream(sms)
                with torch.cuda.stream(st):
                    be_p.plan(b)
                ms = time_on(st, fn)
                out["alone"][f"prefill_T{T}_ctx{ctx}_sms{sms}"] = ms
                s = ProfileSample(PREFILL, shp, sms, ms)
                (held if (T, ctx) == (4096, 4096) or sms in held_splits else fit).append(s)
        for B, ctx in ((8, 1024), (64, 1024), (8, 4096), (64, 4096), (32, 2048)):
            b, fn = dec(B, ctx)
            shp = DecodeShape(B, B * ctx, L)
            for ps in [0, *fit_splits, *held_splits]:
                st = dstream(ps)
                with torch.cuda.stream(st):
                    be_d.plan(b)
                ms = time_on(st, fn)
                sms = total if ps == 0 else total - ps
                out["alone"][f"decode_B{B}_ctx{ctx}_sms{sms}"] = ms
                s = ProfileSample(DECODE, shp, sms, ms)
                (held if (B, ctx) == (32, 2048) or ps in held_splits else fit).append(s)
        print(f"profile alone: {time.perf_counter() - t0:.1f} s", flush=True)
        # Concurrent: one full prefill on the prefill partition while decode steps run on the
        # decode partition; vs the same work time-sliced on the whole GPU (sum of alone times).
        for T, B in ((8192, 64), (2048, 64), (8192, 16)):
            bp, fp = pre(T)
            bd, fd = dec(B, 2048)
            pshape = PrefillShape.from_seqs([(0, T)], L)
            dshape = DecodeShape(B, B * 2048, L)
            with torch.cuda.stream(whole):
                be_p.plan(bp)
                t_p_whole = time_on(whole, fp)
                be_d.plan(bd)
                t_d_whole = time_on(whole, fd)
            for ps in fit_splits + held_splits:
                pr = g.pairs[ps]
                with torch.cuda.stream(pr.prefill.stream):
                    be_p.plan(bp)
                with torch.cuda.stream(pr.decode.stream):
                    be_d.plan(bd)
                torch.cuda.synchronize()
                n_pre = 2
                start = torch.cuda.Event(enable_timing=True)
                start.record(torch.cuda.current_stream())
                pr.prefill.stream.wait_event(start)
                pr.decode.stream.wait_event(start)
                evp = [torch.cuda.Event(enable_timing=True) for _ in range(n_pre + 1)]
                with torch.cuda.stream(pr.prefill.stream):
                    evp[0].record()
                    for i in range(n_pre):
                        fp()
                        evp[i + 1].record()
                evd = []
                with torch.cuda.stream(pr.decode.stream):
                    e0 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    evd.append(e0)
                    while not evp[-1].query() and len(evd) < 300:
                        if len(evd) >= 3:
                            evd[-2].synchronize()
                        fd()
                        e = torch.cuda.Event(enable_timing=True)
                        e.record()
                        evd.append(e)
                torch.cuda.synchronize()
                pre_ms = evp[0].elapsed_time(evp[-1]) / n_pre
                steps = len(evd) - 1
                dec_ms = evd[0].elapsed_time(evd[-1]) / max(steps, 1)
                conc = max(start.elapsed_time(evp[-1]), start.elapsed_time(evd[-1]))
                serial = n_pre * t_p_whole + steps * t_d_whole
                key = f"T{T}_B{B}_split{ps}"
                out["concurrent"][key] = {
                    "prefill_tokens": T,
                    "decode_batch": B,
                    "prefill_sms": ps,
                    "prefill_ms": pre_ms,
                    "decode_step_ms": dec_ms,
                    "decode_steps": steps,
                    "concurrent_ms": conc,
                    "time_sliced_ms": serial,
                    "speedup_vs_time_slice": serial / conc,
                    "prefill_whole_ms": t_p_whole,
                    "decode_whole_ms": t_d_whole,
                }
                print(
                    f"{key}: prefill {pre_ms:.1f} decode {dec_ms:.2f} ({steps} steps) "
                    f"speedup {serial / conc:.2f}",
                    flush=True,
                )
                tgt = held if ps in held_splits or (T, B) == (2048, 64) else fit
                if steps:
                    tgt.append(ProfileSample(PREFILL, pshape, ps, pre_ms, total - ps))
                    tgt.append(ProfileSample(DECODE, dshape, total - ps, dec_ms, ps))
    cm = CostModel.fit(total, fit)
    errs = []
    for s in held:
        pred = cm.predict(s.stage, s.shape, s.sms, s.other_sms)
        errs.append(
            {
                "stage": s.stage,
                "sms": s.sms,
                "other_sms": s.other_sms,
                "shape": str(s.shape),
                "predicted_ms": pred,
                "measured_ms": s.latency_ms,
                "abs_err": abs(pred - s.latency_ms) / s.latency_ms,
            }
        )
    out["held_out"] = errs
    out["cost_model"] = cm.to_dict()
    out["cost_model_mape"] = float(np.mean([e["abs_err"] for e in errs]))
    conc_e = [e["abs_err"] for e in errs if e["other_sms"] > 0]
    out["cost_model_mape_concurrent"] = float(np.mean(conc_e)) if conc_e else None
    out["num_fit_samples"], out["num_held_samples"] = len(fit), len(held)
    # Controller decisions vs the measured best split per concurrent shape.
    ctl_rows = []
    for T, B in ((8192, 64), (2048, 64), (8192, 16)):
        meas = {
            v["prefill_sms"]: v["speedup_vs_time_slice"]
            for v in out["concurrent"].values()
            if v["prefill_tokens"] == T and v["decode_batch"] == B
        }
        for kv in (0.3, 0.9):
            d = SplitController(cm, g.splits).choose(
                PrefillShape.from_seqs([(0, T)], L), DecodeShape(B, B * 2048, L), kv
            )
            ctl_rows.append(
                {
                    "T": T,
                    "B": B,
                    "kv": kv,
                    "chosen": d.prefill_sms,
                    "reason": d.reason,
                    "predicted_speedup": d.speedup_vs_time_slice,
                    "measured_speedup_of_chosen": meas.get(d.prefill_sms),
                    "best_measured": max(meas, key=meas.get) if meas else None,
                    "best_measured_speedup": max(meas.values()) if meas else None,
                }
            )
    out["controller"] = ctl_rows
    # Install the calibrated model in the engine (and save it for the report).
    g.cost_model = cm
    g.controller.model = cm
    RESULTS["calibration"] = {f"{engine.device_name}|{engine.config.model}": cm.to_dict()}
    print(
        f"cost model MAPE held-out {out['cost_model_mape']:.3f} "
        f"(concurrent {out['cost_model_mape_concurrent']})",
        flush=True,
    )
    return out


# -------------------------------------------------------------------------------- load driver
# -------------------------------------------------------------------------------- graphs_split
def split_graphs_check(
    engine: Any,
    splits: list[int] | None = None,
    batches: tuple[int, ...] = (16, 64),
    ctx_tokens: int = 2048,
    iters: int = 5,
) -> dict:
    """Decode CUDA graphs captured per split (issue 6 item 1), on an engine built with
    `cuda_graphs=True` and FlashInfer, BEFORE `engine.start()` (it drives the runner itself).
    Per split: capture (the first through `capture_for_streams`, the others lazily through
    `ensure_split_graphs`, as the PD loop does), check that a decode step on the split's green
    stream picks that split's set and an ordinary stream the whole-GPU set, compare graph vs
    eager logits on the green stream, and time one decode step (eager vs graph) at each batch
    size; the same on the whole GPU for reference. Returns {"rows": [...], "checks": [...]}."""
    from runtime.graphs.decode import cuda_stream_key

    g, runner, model, pool = engine._green, engine.runner, engine.model, engine.kv_pool
    assert g is not None, "no green-context partition"
    reg = runner.graph_registry
    assert reg is not None, "the runner has no CUDA graphs (cuda_graphs=True and FlashInfer?)"
    total = g.layout.total_sms
    splits = splits or [s for s in (64, 96, 112) if s in g.pairs] or g.splits[-3:]
    be_d = runner.decode_backend
    bs = pool.block_size
    per = -(-(ctx_tokens + 1) // bs)  # blocks per sequence
    assert max(batches) * per <= pool.num_blocks, "KV pool too small for the batches"
    assert max(batches) <= runner.config.max_num_seqs
    vocab = engine.model_config.vocab_size
    gen = torch.Generator(device=pool.device).manual_seed(0)
    for t in [*pool.k, *pool.v]:  # defined KV contents (a fresh pool is uninitialised)
        t.normal_(0.0, 0.5, generator=gen)

    def decode_batch(B: int) -> Any:
        from runtime.attention.base import ForwardBatch, SeqSlice

        seqs = [
            SeqSlice(i, 1, ctx_tokens, ctx_tokens + 1, list(range(i * per, (i + 1) * per)))
            for i in range(B)
        ]
        ids = torch.randint(0, vocab, (B,), device=pool.device, generator=gen)
        pos = torch.full((B,), ctx_tokens, dtype=torch.int64, device=pool.device)
        return ForwardBatch(ids, pos, seqs, torch.arange(B, device=pool.device), True)

    rows: list[dict] = []
    checks: list[dict] = []
    whole = torch.cuda.Stream()
    targets: list[tuple[str, int, Any]] = [("whole GPU", total, whole)]
    for i, n in enumerate(splits):
        label = f"{n}/{total - n}"
        ds = g.pairs[n].decode.stream
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        if i == 0:
            runner.capture_for_streams(
                {label: ds},
                progress=lambda d, k, lab, sec: print(
                    f"  captured decode graphs {d}/{k} ({lab}) in {sec:.2f} s", flush=True
                ),
            )
        else:
            runner.ensure_split_graphs(ds, label)  # the PD loop's lazy path
        cap_s = time.perf_counter() - t0
        mem = free0 - torch.cuda.mem_get_info()[0]
        print(f"split {label}: graphs captured in {cap_s:.2f} s, {mem / 2**20:.0f} MiB", flush=True)
        checks.append(
            {
                "check": f"capture {label}",
                "capture_s": cap_s,
                "device_mib": mem / 2**20,
                "ok": reg.summary()[label]["captured"],
            }
        )
        targets.append((label, total - n, ds))

    with torch.inference_mode():
        for label, dsms, st in targets:
            with torch.cuda.stream(st):
                picked = runner.current_decode_graphs()
            if label == "whole GPU":
                ok = picked is runner.decode_graphs
            else:
                ok = (
                    picked is not None
                    and picked is not runner.decode_graphs
                    and cuda_stream_key(picked.stream) == cuda_stream_key(st)
                )
            checks.append({"check": f"picks the set of stream {label}", "ok": bool(ok)})
            for B in batches:
                b = decode_batch(B)

                def eager(b: Any = b) -> Any:
                    be_d.plan(b)
                    return model(b.input_ids, b.positions, be_d)

                def graph(b: Any = b) -> Any:
                    gs = runner.current_decode_graphs()  # the per-step lookup, as the runner
                    return gs.run(b)

                with torch.cuda.stream(st):
                    le = model.compute_logits(eager())
                    lg = model.compute_logits(graph())
                st.synchronize()
                diff = float((le - lg).abs().max())
                scale = float(le.abs().max())
                agree = float((le.argmax(-1) == lg.argmax(-1)).float().mean())
                checks.append(
                    {
                        "check": f"graph == eager logits, {label}, B={B}",
                        "max_abs_diff": diff,
                        "max_abs_logit": scale,
                        "argmax_agreement": agree,
                        "ok": bool(diff <= 0.02 * scale + 1e-3),
                    }
                )
                e_ms = time_on(st, eager, iters=iters, warmup=2)
                g_ms = time_on(st, graph, iters=iters, warmup=2)
                rows.append(
                    {
                        "split": label,
                        "decode_sms": dsms,
                        "batch": B,
                        "ctx_tokens": ctx_tokens,
                        "eager_ms": e_ms,
                        "graph_ms": g_ms,
                        "speedup": e_ms / g_ms if g_ms else None,
                    }
                )
    return {
        "rows": rows,
        "checks": checks,
        "registry": reg.summary(),
        "ok": all(c["ok"] for c in checks),
    }


def graphs_split_table(res: dict) -> str:
    lines = [
        "| split (prefill/decode SMs) | batch | eager ms | graph ms | speedup |",
        "|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['split']} | {r['batch']} | {r['eager_ms']:.2f} | "
            f"{r['graph_ms']:.2f} | {r['speedup']:.2f} |"
        )
    bad = [c["check"] for c in res["checks"] if not c["ok"]]
    lines.append(
        f"checks: {len(res['checks']) - len(bad)}/{len(res['checks'])} ok"
        + (f"; FAILED: {bad}" if bad else "")
    )
    return "\n".join(lines)


class Sink:
    def __init__(self) -> None:
        self.events: dict[str, list[float]] = {}
        self.done: dict[str, Any] = {}
        self.tokens: dict[str, list[int]] = {}
        self.cv = threading.Condition()

    def __call__(self, outs: list[Any]) -> None:  # one engine step's outputs
        now = time.monotonic()
        with self.cv:
            for o in outs:
                if o.new_token_ids:
                    self.events.setdefault(o.request_id, []).append(now)
                    self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    self.done[o.request_id] = o
            self.cv.notify_all()

    def wait(self, ids: list[str], timeout_s: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: all(i in self.done for i in ids), timeout=timeout_s)


def lengths(workload: str, n: int, scale: float, rng: random.Random) -> list[tuple[int, int]]:
    def ln(mean: float, sigma: float, lo: int, hi: int) -> int:
        mu = math.log(mean) - sigma * sigma / 2
        return int(min(hi, max(lo, rng.lognormvariate(mu, sigma))))

    out = []
    for _ in range(n):
        w = workload
        if w == "mixed":
            w = "sharegpt" if rng.random() < 0.6 else "long-data"
        if w == "long-data":
            i, o = ln(5900, 0.5, 1000, 16000), ln(180, 0.6, 16, 512)
        elif w == "arxiv":
            i, o = ln(3800, 0.5, 1000, 12000), ln(250, 0.5, 32, 768)
        else:
            i, o = ln(250, 1.0, 4, 2048), ln(200, 0.9, 4, 1024)
        out.append((max(1, int(i * scale)), max(2, int(o * scale))))
    return out


def run_load(
    engine: Any,
    sink: Sink,
    tag: str,
    workload: str,
    n: int,
    qps: float,
    scale: float,
    seed: int,
    timeout_s: float,
) -> dict:
    from runtime.request import Request, RequestKind, SamplingParams

    rng = random.Random(seed)
    lens = lengths(workload, n, scale, rng)
    gaps = [rng.expovariate(qps) for _ in range(n)]
    ids = [f"{tag}-{i}" for i in range(n)]
    t_start = time.monotonic()
    sent: dict[str, float] = {}
    t = t_start
    for rid, (ni, no), gap in zip(ids, lens, gaps, strict=True):
        t += gap
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        prompt = [rng.randrange(100, 40000) for _ in range(ni)]
        req = Request(
            rid,
            RequestKind.GENERATE,
            prompt,
            sampling=SamplingParams(max_tokens=no, temperature=0.0, ignore_eos=True),
        )
        sent[rid] = time.monotonic()
        engine.add(req)
    ok = sink.wait(ids, timeout_s)
    t_end = max((sink.events[r][-1] for r in ids if sink.events.get(r)), default=time.monotonic())
    ttft, tbt, n_out, failed = [], [], 0, 0
    per_req_tbt_p99 = []
    for r in ids:
        ev = sink.events.get(r, [])
        o = sink.done.get(r)
        if o is None or o.error or not ev:
            failed += 1
            continue
        ttft.append((ev[0] - sent[r]) * 1e3)
        gaps_ms = [(b - a) * 1e3 for a, b in zip(ev, ev[1:], strict=False)]
        tbt.extend(gaps_ms)
        if gaps_ms:
            per_req_tbt_p99.append(float(np.percentile(gaps_ms, 99)))
        n_out += len(sink.tokens.get(r, []))

    def st(x: list[float]) -> dict:
        if not x:
            return {"mean": None, "p50": None, "p99": None}
        return {
            "mean": float(np.mean(x)),
            "p50": float(np.percentile(x, 50)),
            "p99": float(np.percentile(x, 99)),
        }

    span = max(t_end - t_start, 1e-9)
    return {
        "tag": tag,
        "workload": workload,
        "n": n,
        "qps": qps,
        "scale": scale,
        "completed_all": ok,
        "failed": failed,
        "ttft_ms": st(ttft),
        "tbt_ms": st(tbt),
        "output_tok_per_s": n_out / span,
        "req_per_s": (n - failed) / span,
        "span_s": span,
        "stats": {
            k: engine.stats().get(k)
            for k in (
                "partition",
                "prefill_sms",
                "decode_sms",
                "cost_model_mape",
                "pd_split_prefills",
                "pd_overlapped_decode_steps",
                "num_preemptions",
            )
        },
    }


def slo_attainment(run: dict, ttft_slo_ms: float, tbt_slo_ms: float) -> dict:
    return {
        "ttft_p99_ok": (run["ttft_ms"]["p99"] or 1e18) <= ttft_slo_ms,
        "tbt_p99_ok": (run["tbt_ms"]["p99"] or 1e18) <= tbt_slo_ms,
    }


# ---------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen2.5-3b")
    ap.add_argument("--tokenizer-dir", default=".gl/smollm2-tok")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="profile,correctness,serve")
    ap.add_argument("--workloads", default="long-data,arxiv,mixed")
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--qps", default="long-data:6,arxiv:8,mixed:10")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--modes", default="off,best,auto")
    ap.add_argument("--run-timeout", type=float, default=60.0)
    ap.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="decode CUDA graphs in the engine (auto: on iff graphs_split runs)",
    )
    args = ap.parse_args()
    _tok_patch(args.tokenizer_dir)
    RESULTS.update(
        command=" ".join(__import__("sys").argv),
        date=time.strftime("%Y-%m-%d"),
        device=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        model=args.model,
    )
    try:
        RESULTS["git"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        RESULTS["git"] = None
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.model import ops

    try:
        ops.use_flashinfer(True)
    except Exception as e:  # noqa: BLE001
        RESULTS["errors"]["flashinfer_ops"] = repr(e)
    sink = Sink()
    t0 = time.perf_counter()
    sections = args.sections.split(",")
    # Decode graphs per split exist since issue 6 item 1; earlier runs used eager decode.
    graphs = args.cuda_graphs == "on" or (args.cuda_graphs == "auto" and "graphs_split" in sections)
    RESULTS["cuda_graphs"] = graphs
    cfg = EngineConfig(
        model=args.model,
        partition="off",
        attention_backend="flashinfer",
        gpu_memory_utilization=0.80,
        max_model_len=20000,
        prefill_token_budget=8192,
        cuda_graphs=graphs,
        prefill_policy="fcfs",
    )
    engine = Engine(cfg, sink)
    RESULTS["engine_init_s"] = time.perf_counter() - t0
    st = engine.partition.state()
    RESULTS["partition_state"] = {
        "available": st.available,
        "reason": st.reason,
        "splits": st.splits,
        "total_sms": st.total_sms,
    }
    RESULTS["attention_backend"] = engine.backend.name
    print(f"engine ready in {RESULTS['engine_init_s']:.1f} s; partition {st}", flush=True)
    path = Path(args.out)

    def save() -> None:
        path.write_text(json.dumps(RESULTS, indent=1, default=str))

    if "graphs_split" in sections:
        try:
            RESULTS["sections"]["graphs_split"] = split_graphs_check(engine)
            print(graphs_split_table(RESULTS["sections"]["graphs_split"]), flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            RESULTS["errors"]["graphs_split"] = f"{type(e).__name__}: {e}"
        save()

    if "profile" in sections:
        try:
            RESULTS["sections"]["profile"] = section_profile(engine)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            RESULTS["errors"]["profile"] = f"{type(e).__name__}: {e}"
        save()
    engine.start()
    prof = RESULTS["sections"].get("profile", {})
    best = None
    if prof.get("concurrent"):
        rows = [
            v
            for v in prof["concurrent"].values()
            if v["prefill_tokens"] == 8192 and v["decode_batch"] == 64
        ]
        best = max(rows, key=lambda v: v["speedup_vs_time_slice"])["prefill_sms"]
    best = best or 64
    RESULTS["best_static_split"] = best

    def set_mode(spec: str) -> None:
        engine.partition.set_mode(spec)
        time.sleep(0.05)
        engine.reset_prefix_cache()
        time.sleep(0.05)

    if "correctness" in sections:
        try:
            from runtime.request import Request, RequestKind, SamplingParams

            res: dict[str, Any] = {}
            toks: dict[str, list[list[int]]] = {}
            for spec in ("off", f"static:{best}"):
                set_mode(spec)
                rng = random.Random(7)
                ids = []
                for i, n in enumerate((3000, 700, 5000, 1200)):
                    rid = f"corr-{spec}-{i}"
                    ids.append(rid)
                    engine.add(
                        Request(
                            rid,
                            RequestKind.GENERATE,
                            [rng.randrange(100, 40000) for _ in range(n)],
                            sampling=SamplingParams(
                                max_tokens=24, temperature=0.0, ignore_eos=True
                            ),
                        )
                    )
                    time.sleep(0.02)
                assert sink.wait(ids, 60), "correctness requests timed out"
                toks[spec] = [sink.tokens.get(r, []) for r in ids]
            a, b = toks["off"], toks[f"static:{best}"]
            same = sum(x == y for x, y in zip(a, b, strict=True))
            first = sum(x[:1] == y[:1] for x, y in zip(a, b, strict=True))
            res.update(
                requests=len(a),
                identical_sequences=same,
                identical_first_token=first,
                lengths_ok=all(len(x) == 24 for x in a + b),
                stats=engine.stats(),
            )
            if engine.runner.graph_registry is not None:  # which decode graph sets exist
                res["decode_graph_sets"] = engine.runner.graph_registry.summary()
            RESULTS["sections"]["correctness"] = res
            print(
                f"correctness: {same}/{len(a)} identical, first token {first}/{len(a)}", flush=True
            )
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            RESULTS["errors"]["correctness"] = f"{type(e).__name__}: {e}"
        save()

    if "serve" in sections:
        qps = dict(kv.split(":") for kv in args.qps.split(","))
        runs = []
        for wl in args.workloads.split(","):
            for m in args.modes.split(","):
                spec = f"static:{best}" if m == "best" else m
                try:
                    set_mode(spec)
                    r = run_load(
                        engine,
                        sink,
                        f"{wl}-{m}",
                        wl,
                        args.n,
                        float(qps[wl]),
                        args.scale,
                        seed=11,
                        timeout_s=args.run_timeout,
                    )
                    r["mode"] = spec
                    runs.append(r)
                    print(
                        f"{wl:10s} {spec:10s} tok/s {r['output_tok_per_s']:8.0f} "
                        f"TTFT mean/p99 {r['ttft_ms']['mean']:.0f}/{r['ttft_ms']['p99']:.0f} "
                        f"TBT mean/p99 {r['tbt_ms']['mean']:.1f}/{r['tbt_ms']['p99']:.1f} "
                        f"failed {r['failed']} {r['stats']}",
                        flush=True,
                    )
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    RESULTS["errors"][f"serve-{wl}-{m}"] = f"{type(e).__name__}: {e}"
                RESULTS["sections"]["serve"] = runs
                save()
    # Summary: geometric means over workloads of auto / off.
    runs = RESULTS["sections"].get("serve", [])

    def ratio(key: Any) -> float | None:
        rs = []
        for wl in {r["workload"] for r in runs}:
            a = next((r for r in runs if r["workload"] == wl and r["mode"] == "auto"), None)
            o = next((r for r in runs if r["workload"] == wl and r["mode"] == "off"), None)
            if a and o and key(a) and key(o):
                rs.append(key(a) / key(o))
        return float(np.exp(np.mean(np.log(rs)))) if rs else None

    RESULTS["summary"] = {
        "throughput_ratio_auto_vs_off": ratio(lambda r: r["output_tok_per_s"]),
        "p99_tbt_ratio_auto_vs_off": ratio(lambda r: r["tbt_ms"]["p99"]),
        "p99_ttft_ratio_auto_vs_off": ratio(lambda r: r["ttft_ms"]["p99"]),
        "mean_tbt_ratio_auto_vs_off": ratio(lambda r: r["tbt_ms"]["mean"]),
        "mean_ttft_ratio_auto_vs_off": ratio(lambda r: r["ttft_ms"]["mean"]),
        "cost_model_mape": prof.get("cost_model_mape"),
        "cost_model_mape_concurrent": prof.get("cost_model_mape_concurrent"),
        "cost_model_online_mape": engine.stats().get("cost_model_mape"),
        "best_static_split": best,
    }
    save()
    engine.shutdown(0)
    print(json.dumps(RESULTS["summary"], indent=1), flush=True)
    print(f"errors: {RESULTS['errors']}", flush=True)
    if "graphs_split" in RESULTS["sections"]:
        print(graphs_split_table(RESULTS["sections"]["graphs_split"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
