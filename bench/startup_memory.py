"""What a server's start-up sizes, by option set: one server at a time, each started until
healthy and stopped; its start-up time and the log lines that say how memory was split (hybrid
prefill's chunk, the activation reserve the dry runs measured, the KV cache) in one JSON.

The product path's own figures: what `make serve` / `python -m app serve` decides on this
machine, read off its log, not recomputed here.

    python -m bench.startup_memory --model random:llama-3.1-8b --side auto= \
        --side c2k=--prefill-chunk-tokens 2048 --rev REV --out startup-memory.json
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

# The start-up log's lines on memory (runtime/engine.py) and readiness (app/main.py).
MEMORY_LINES = re.compile(
    r"hybrid prefill's chunk|activation peak measured|KV cache:|scoring prompts limited|"
    r"engine ready"
)
KV_LINE = re.compile(r"KV cache: (\d+) blocks of (\d+) tokens, (\d+) tokens, ([\d.]+) GiB")
CHUNK_LINE = re.compile(r"hybrid prefill's chunk: (\d+) tokens")
RESERVE_LINE = re.compile(r"reserving ([\d.]+) GiB \(scoring prompts up to (\d+) tokens\)")


def read_startup_log(text: str) -> dict[str, Any]:
    """The memory lines of a server's log and the numbers in them (None where a line is
    missing: e.g. no chunk line when the option was given, no reserve with --num-kv-blocks)."""
    lines = [line for line in text.splitlines() if MEMORY_LINES.search(line)]
    joined = "\n".join(lines)
    kv, chunk, reserve = (
        KV_LINE.search(joined),
        CHUNK_LINE.search(joined),
        RESERVE_LINE.search(joined),
    )
    return {
        "lines": lines,
        "kv_blocks": int(kv.group(1)) if kv else None,
        "kv_tokens": int(kv.group(3)) if kv else None,
        "kv_gib": float(kv.group(4)) if kv else None,
        "auto_chunk_tokens": int(chunk.group(1)) if chunk else None,
        "activation_reserve_gib": float(reserve.group(1)) if reserve else None,
        "max_score_tokens": int(reserve.group(2)) if reserve else None,
    }


def parse_side(text: str) -> tuple[str, list[str]]:
    """`NAME=server options` -> (NAME, argv)."""
    name, sep, opts = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--side takes NAME=options, got {text!r}")
    return name, shlex.split(opts)


def main(argv: list[str] | None = None) -> int:
    from bench.gpu_scheduling import device_name
    from bench.gpu_serving import Server
    from bench.prefill_profile import git_revision

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--side", type=parse_side, action="append", required=True)
    ap.add_argument("--port", type=int, default=8031)
    ap.add_argument("--timeout-s", type=float, default=400.0)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/serving"))
    ap.add_argument("--rev")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "tool": "bench.startup_memory",
        "command": "python -m bench.startup_memory "
        + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
        "git_revision": git_revision(args.rev),
        "device": device_name(False),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": args.model,
        "sides": {},
    }
    rc = 0
    for name, extra in args.side:
        log_path = args.log_dir / f"startup-{name}.log"
        server = Server(args.model, args.port, extra, log_path)
        side: dict[str, Any] = {"server_args": extra}
        try:
            side["startup_s"] = round(server.start(args.timeout_s), 1)
        except Exception as e:  # noqa: BLE001 - recorded; the next side still runs
            side["error"] = repr(e)[:300]
            rc = 1
        finally:
            server.stop()
        side.update(read_startup_log(server.log_tail(200_000)))
        out["sides"][name] = side
        print(f"{name}: {json.dumps({k: v for k, v in side.items() if k != 'lines'})}", flush=True)
        args.out.write_text(json.dumps(out, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
