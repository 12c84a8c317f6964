"""Decode attention in CUDA graphs: FlashInfer's split-KV plan against one chunk a request
(diagnostic for issue 12, GPU; not a headline).

In CUDA-graph mode FlashInfer 0.5.3's tensor-core decode plan always splits the KV and adds a
merge kernel a layer (scheduler.cuh, `PrefillBinarySearchKVChunkSize` returns split for every
graph plan), even when each request ends up in one chunk. `disable_split_kv=True` is not a way
out: its chunk size is INT64_MAX, which the plan then multiplies by the page size (overflow;
wrong results and an illegal access on the H200, 2026-12-02). `fixed_split_size` = the pages of
the longest request is: no request splits, no merge runs. Whether that is faster depends on the
batch and the contexts: fewer CTAs, each over its whole context, against more CTAs plus a merge
kernel and its launch gap.

For each shape, batch and context length this captures LAYERS consecutive attention calls (each
over its own layer's KV, so the L2 does not hold them) into one graph per variant, the way the
engine captures a decode step (planned on a dummy one-token batch, re-planned on the real one
before replay), times the replays and checks both variants against an eager reference.

    python3 -m bench.attention_split --out $OUT/attention-split.json
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from bench.bursts import git_revision

SHAPES = {  # name: (q heads, kv heads, head dim, layers of a real step)
    "qwen2.5-3b": (16, 2, 128, 36),
    "llama-3.1-8b": (32, 8, 128, 32),
}
PAGE = 16


def measure(
    shape: str, batch: int, context: int, layers: int, replays: int, seed: int = 0
) -> dict[str, Any]:
    import flashinfer
    import torch

    hq, hkv, d, _ = SHAPES[shape]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    pages = (context + PAGE - 1) // PAGE
    num_pages = batch * pages + 1  # + a pad page for the dummy plan
    caches = [
        torch.randn(num_pages, 2, PAGE, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        for _ in range(layers)
    ]
    # Each request's pages at random places in the pool, like a pool after churn.
    perm = torch.randperm(num_pages - 1, device=dev, generator=g).to(torch.int32)
    indices = perm[: batch * pages].contiguous()
    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32)
    last = torch.full((batch,), context - (pages - 1) * PAGE, dtype=torch.int32)
    qs = [
        torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
        for _ in range(layers)
    ]
    ws_eager = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ref_w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws_eager, "NHD", use_tensor_cores=True)
    ref_w.plan(indptr, indices, last, hq, hkv, d, PAGE, q_data_type=torch.bfloat16)
    ref = ref_w.run(qs[0], caches[0])

    def graph_variant(fixed_pages: int | None) -> tuple[float, float]:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        ip = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        ix = torch.zeros(max(batch * pages, 1), dtype=torch.int32, device=dev)
        lp = torch.ones(batch, dtype=torch.int32, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws,
            "NHD",
            use_tensor_cores=True,
            use_cuda_graph=True,
            paged_kv_indptr_buffer=ip,
            paged_kv_indices_buffer=ix,
            paged_kv_last_page_len_buffer=lp,
        )
        extra = {} if fixed_pages is None else {"fixed_split_size": fixed_pages}
        # Capture on a dummy plan (every row one token in the pad page), as the engine does.
        pad = torch.full((batch,), num_pages - 1, dtype=torch.int32, device=dev)
        w.plan(
            torch.arange(batch + 1, dtype=torch.int32),
            pad,
            torch.ones(batch, dtype=torch.int32),
            hq,
            hkv,
            d,
            PAGE,
            q_data_type=torch.bfloat16,
            **extra,
        )
        outs = [torch.empty_like(q) for q in qs]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                for i in range(layers):
                    w.run(qs[i], caches[i], out=outs[i])
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(layers):
                w.run(qs[i], caches[i], out=outs[i])
        w.plan(indptr, indices, last, hq, hkv, d, PAGE, q_data_type=torch.bfloat16, **extra)
        graph.replay()
        torch.cuda.synchronize()
        err = ((outs[0].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000.0 / replays / layers, err

    split_us, split_err = graph_variant(None)
    one_us, one_err = graph_variant(pages)
    kv_bytes = batch * context * 2 * hkv * d * 2
    return {
        "shape": shape,
        "batch": batch,
        "context": context,
        "split_us_per_layer": round(split_us, 2),
        "one_chunk_us_per_layer": round(one_us, 2),
        "one_chunk_over_split": round(one_us / split_us, 3),
        "kv_bytes_per_layer": kv_bytes,
        "rel_err_split": split_err,
        "rel_err_one_chunk": one_err,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen2.5-3b,llama-3.1-8b")
    ap.add_argument("--batches", default="1,16,32,48,64,128")
    ap.add_argument("--contexts", default="256,512,768,1024,2048,4096")
    ap.add_argument("--layers", type=int, default=8, help="attention calls a graph (own KV each)")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    result: dict[str, Any] = {
        "what": "decode attention per layer in CUDA graphs: FlashInfer split-KV + merge vs one "
        "chunk a request (fixed_split_size = the request's pages); diagnostic",
        "command": "python3 -m bench.attention_split "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "git_revision": git_revision(),
        "device": torch.cuda.get_device_name(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "rows": [],
    }
    for shape in args.shapes.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            for c in (int(x) for x in args.contexts.split(",")):
                r = measure(shape, b, c, args.layers, args.replays)
                result["rows"].append(r)
                print(
                    f"{shape} b={b} ctx={c} split={r['split_us_per_layer']}us "
                    f"one={r['one_chunk_us_per_layer']}us x{r['one_chunk_over_split']} "
                    f"err={r['rel_err_split']:.1e}/{r['rel_err_one_chunk']:.1e}",
                    flush=True,
                )
                torch.cuda.empty_cache()
                if args.out:  # after every row: a run cut short keeps what it measured
                    with open(args.out, "w") as f:
                        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
