"""Host time a step spends on structured outputs' masks (engine-level diagnostic).

Each step with constrained rows advances their llguidance matchers by the token each sampled
last and fills their next-token bitmasks (`runtime.sampling.structured.GrammarMasks.fill`), on the
engine thread before sampling. This times that call in the steady state (one new token a
row) for a JSON schema mid-object and a `choice`, at 1 / 16 / 64 rows, with the served
tokenizer (the default model's unless `--tokenizer-dir`). Host time only: it adds to a
step's host work whatever the device.

    python -m bench.grammar_masks [--repeats 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.serve import git_revision, machine_info
from runtime.sampling.structured import (
    GrammarMasks,
    compile_response_format,
    compile_structured_outputs,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
# What each constrained row has written so far; the timed call consumes the last token.
OUTPUTS = {"json_schema": '{"name":"Ada Lovelace","age":36,"tags":["math', "choice": "neg"}


def measure(tokenizer_dir: Path, rows_list: list[int], repeats: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    text = (tokenizer_dir / "tokenizer.json").read_text()
    tok = Tokenizer.from_str(text)
    masks = GrammarMasks(lambda: text, ())
    grammars = {
        "json_schema": compile_response_format(
            {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        ),
        "choice": compile_structured_outputs({"choice": ["positive", "negative", "neutral"]}),
    }
    out: dict[str, Any] = {}
    for kind, grammar in grammars.items():
        assert grammar is not None
        written = tok.encode(OUTPUTS[kind], add_special_tokens=False).ids
        for rows in rows_list:
            times = []
            for rep in range(repeats):
                ids = [f"{kind}-{rows}-{rep}-{i}" for i in range(rows)]
                for rid in ids:
                    masks.prepare(rid, grammar)
                buf = np.zeros((rows, masks.words_per_mask), dtype=np.int32)
                masks.fill([(rid, grammar, written[:-1]) for rid in ids], buf)
                t0 = time.perf_counter()
                masks.fill([(rid, grammar, written) for rid in ids], buf)  # one new token a row
                times.append(time.perf_counter() - t0)
                for rid in ids:
                    masks.release(rid)
            times.sort()
            out[f"{kind} x{rows}"] = {
                "rows": rows,
                "fill_ms_median": round(statistics.median(times) * 1e3, 3),
                "fill_ms_p90": round(times[int(0.9 * (len(times) - 1))] * 1e3, 3),
            }
            print(f"{kind:<12} {rows:>3} rows: {out[f'{kind} x{rows}']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from runtime.model.convert import ensure_default_model

    ap = argparse.ArgumentParser(prog="python -m bench.grammar_masks", description=__doc__)
    ap.add_argument("--tokenizer-dir", type=Path, help="default: the default model's folder")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    folder = args.tokenizer_dir or ensure_default_model()
    results = {
        "what": "host time of GrammarMasks.fill per step, one new token a row "
        "(engine-level diagnostic)",
        "command": " ".join(["python -m bench.grammar_masks", *(argv or sys.argv[1:])]),
        **git_revision(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "tokenizer": str(folder),
        "results": measure(folder, [int(r) for r in args.rows.split(",")], args.repeats),
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
