"""Where a hybrid prefill's activation memory goes, per prompt token (diagnostic, GPU).

The engine reserves activation memory at start-up from dry-run prefills
(`runtime.runner.profile_activation_peak`: one step's peak, then a fixed part and a slope per
token between two lengths at and above 16 chunks, `activation_probe_lengths`), and that reserve
bounds the longest scoring prompt. Found with this tool (2026-12-02, H200, 8B shape): the dry
run took the torch paths of the norms and RoPE (fp32 temporaries; FlashInfer's ops were switched
on only later, by the runner), 44.5 KiB a token where the layer's own buffers explain ~36, and a
slope measured between 8,192 and 16,384 tokens straddles the point where the attention phase's
buffers overtake the chunked MLP's temporaries. This runs the same dry run at two lengths with
CUDA's allocator history on, replays the trace to the moment of the peak, and attributes the
bytes live then to the line of our code that allocated them: a site whose bytes grow with the
prompt is a per-token cost, and the difference between the two lengths says by how much.

    python3 -m bench.activation_memory --model random:llama-3.1-8b \
        --out $OUT/activation-memory.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from bench.bursts import git_revision

# Frames from these folders are "ours"; the first one up the stack names the site.
OUR_CODE = ("/runtime/", "/bench/")


def site_of(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in our code ('runtime/model/llama.py:212 forward_chunked'), else
    the innermost frame at all, else '?'."""
    for f in frames:
        name = str(f.get("filename", ""))
        if any(part in name for part in OUR_CODE):
            short = name[name.rfind("/runtime/") + 1 :] if "/runtime/" in name else name
            return f"{short}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"
    return "?"


def live_at_peak(events: list[dict[str, Any]]) -> tuple[int, dict[str, int]]:
    """Replay allocator events (torch.cuda.memory._snapshot()['device_traces'][d]) and return
    the highest total of bytes allocated during the trace and, at that moment, the live bytes
    by allocation site. Blocks allocated before the trace began are not in it (not counted):
    the result is what the traced work allocated on top of them."""
    # Pass 1: when the total peaked (the index of that event). Pass 2: what was live then.
    sizes: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for i, ev in enumerate(events):
        action = ev.get("action")
        if action == "alloc":
            sizes[int(ev["addr"])] = int(ev["size"])
            total += int(ev["size"])
            if total > peak:
                peak, peak_at = total, i
        elif action == "free_completed":
            total -= sizes.pop(int(ev["addr"]), 0)
    live: dict[int, tuple[int, str]] = {}
    for ev in events[: peak_at + 1]:
        if ev.get("action") == "alloc":
            live[int(ev["addr"])] = (int(ev["size"]), site_of(ev.get("frames") or []))
        elif ev.get("action") == "free_completed":
            live.pop(int(ev["addr"]), None)
    by_site: dict[str, int] = defaultdict(int)
    for size, where in live.values():
        by_site[where] += size
    return peak, dict(by_site)


def per_token(
    small: tuple[int, dict[str, int]], large: tuple[int, dict[str, int]], d_tokens: int
) -> list[dict[str, Any]]:
    """Sites ordered by how much they grow per token between the two lengths."""
    sites = set(small[1]) | set(large[1])
    rows = [
        {
            "site": s,
            "bytes_small": small[1].get(s, 0),
            "bytes_large": large[1].get(s, 0),
            "bytes_per_token": (large[1].get(s, 0) - small[1].get(s, 0)) / d_tokens,
        }
        for s in sites
    ]
    rows.sort(key=lambda r: -abs(r["bytes_per_token"]))
    return rows


def trace_dry_run(model: Any, mc: Any, cfg: Any, num_tokens: int) -> tuple[int, dict]:
    """One `profile_activation_peak` dry run of `num_tokens` under the allocator history."""
    import torch

    from runtime.engine import make_attention_backend
    from runtime.runner import profile_activation_peak

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
    try:
        measured = profile_activation_peak(
            cfg,
            model,
            mc,
            num_tokens,
            lambda pool: make_attention_backend(cfg, pool, mc.num_q_heads),
        )
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.empty_cache()
    peak, by_site = live_at_peak(snap["device_traces"][torch.cuda.current_device()])
    return measured, {"traced_peak_bytes": peak, "by_site": by_site}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.activation_memory")
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument(
        "--tokens", type=int, nargs=2, default=None, help="default: the engine's two lengths"
    )
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch

    from runtime.config import EngineConfig
    from runtime.model.loader import load_model

    cfg = EngineConfig(model=args.model, prefill_chunk_tokens=args.chunk_tokens)
    model, mc, _ = load_model(args.model, torch.bfloat16, "cuda", seed=0)
    if args.tokens:
        n1, n2 = args.tokens
    else:
        from runtime.runner import activation_probe_lengths

        _, n1, n2 = activation_probe_lengths(cfg.prefill_token_budget, args.chunk_tokens, 1 << 18)
    m1, t1 = trace_dry_run(model, mc, cfg, n1)
    m2, t2 = trace_dry_run(model, mc, cfg, n2)
    rows = per_token(
        (t1["traced_peak_bytes"], t1["by_site"]), (t2["traced_peak_bytes"], t2["by_site"]), n2 - n1
    )
    res = {
        "command": "python3 -m bench.activation_memory "
        f"--model {args.model} --tokens {n1} {n2} --chunk-tokens {args.chunk_tokens}",
        "git_revision": git_revision(),  # GREENLANE_REVISION first: a device copy's git lags
        "device": torch.cuda.get_device_name(0),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "what": "diagnostic: the engine's start-up dry-run prefill, allocations live at its peak",
        "measured_peak_bytes": [m1, m2],
        "measured_slope_bytes_per_token": (m2 - m1) / (n2 - n1),
        "traced_peak_bytes": [t1["traced_peak_bytes"], t2["traced_peak_bytes"]],
        "sites": rows[:40],
    }
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"measured slope {res['measured_slope_bytes_per_token'] / 1024:.1f} KiB/token")
    for r in rows[:15]:
        print(f"{r['bytes_per_token'] / 1024:8.2f} KiB/token  {r['site']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
