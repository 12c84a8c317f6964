"""GPU start-up check of the engine: measured activation reserve, `--max-score-tokens`
refusal, the partition calibration choice (start-up profile in `auto`), and one request of
each kind end to end. Writes JSON to --out and prints a short table last.

    python3 -m bench.gpu_startup_check --model random:qwen2.5-3b --out $OUT/startup.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import tempfile
import threading
import time
from datetime import UTC, datetime

import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.request import EngineOutput, Request, RequestKind, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen2.5-3b")
    ap.add_argument("--partition", default="auto")
    ap.add_argument("--max-score-tokens", type=int, default=65536)
    ap.add_argument("--rev", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    res: dict = {
        "command": "python3 -m bench.gpu_startup_check "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "git_revision": args.rev or _git_rev(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "checks": {},
    }
    outs: dict[str, list[EngineOutput]] = {}
    cv = threading.Condition()

    def sink(step_outs: list[EngineOutput]) -> None:  # one engine step's outputs
        with cv:
            for o in step_outs:
                outs.setdefault(o.request_id, []).append(o)
            cv.notify_all()

    t0 = time.perf_counter()
    cfg = EngineConfig(
        model=args.model,
        partition=args.partition,
        max_score_tokens=args.max_score_tokens,
        partition_calibration_dir=tempfile.mkdtemp(),
    )
    eng = Engine(cfg, sink)
    res["engine_init_s"] = time.perf_counter() - t0
    res["kv_blocks"] = eng.block_manager.num_blocks
    res["max_score_tokens"] = eng.max_score_tokens
    res["partition"] = eng.stats().get("partition")
    res["partition_state"] = {
        k: v
        for k, v in dataclasses.asdict(eng.partition.state()).items()
        if isinstance(v, (int, float, str, bool, type(None)))
    }
    eng.start()
    try:
        n_long = eng.max_score_tokens + 1
        eng.add(Request("too-long", RequestKind.SCORE, [1] * n_long, label_token_ids=[1, 2]))
        eng.add(
            Request(
                "score",
                RequestKind.SCORE,
                list(range(100, 100 + min(4096, eng.max_score_tokens))),
                label_token_ids=[5, 6],
            )
        )
        eng.add(
            Request(
                "gen",
                RequestKind.GENERATE,
                list(range(10, 300)),
                SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
            )
        )
        with cv:
            ok = cv.wait_for(
                lambda: all(
                    outs.get(r) and outs[r][-1].finished for r in ("too-long", "score", "gen")
                ),
                timeout=60,
            )
        res["checks"]["all_finished"] = ok
        tl = outs["too-long"][-1]
        res["checks"]["too_long_refused_with_max"] = tl.finish_reason == "error" and str(
            eng.max_score_tokens
        ) in (tl.error or "")
        res["too_long_error"] = tl.error
        res["checks"]["score_has_probs"] = outs["score"][-1].label_probs is not None
        ntok = sum(len(o.new_token_ids) for o in outs["gen"])
        res["checks"]["gen_32_tokens"] = ntok == 32
        res["stats"] = {k: v for k, v in eng.stats().items() if not isinstance(v, (dict, list))}
    finally:
        eng.shutdown(0)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("\n== startup check ==")
    for k in ("engine_init_s", "kv_blocks", "max_score_tokens", "partition"):
        print(f"{k:24s} {res.get(k)}")
    for k, v in res["checks"].items():
        print(f"{k:24s} {'PASS' if v else 'FAIL'}")


def _git_rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - the device copy has no .git
        return "unknown"


if __name__ == "__main__":
    main()
