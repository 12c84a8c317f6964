"""bench.cost_replay end to end on a made-up server run: a profile in the log, a step trace."""

from __future__ import annotations

import json
from pathlib import Path

from bench import cost_replay

LOG = """\
[partition profile] NVIDIA H200 (132 SMs), random:tiny: splits [112]
[partition profile 1/4] prefill  tokens= 4096 ctx=    0 on 132 SMs:     41.22 ms  (elapsed 0 s)
[partition profile 2/4] prefill  tokens= 1024 ctx= 4096 on 132 SMs:     14.40 ms  (elapsed 0 s)
[partition profile 3/4] decode   batch=   16 ctx= 1024 on 132 SMs:      3.09 ms  (elapsed 0 s)
[partition profile 4/4] decode   batch=   64 ctx= 2048 on 132 SMs:      5.22 ms  (elapsed 0 s)
[partition profile 5/6] prefill  tokens= 4096 ctx=    0 on 112 SMs:     58.48 ms  (elapsed 0 s)
[partition profile 6/6] decode   batch=   64 ctx= 2048 on  20 SMs:     13.83 ms  (elapsed 0 s)
[partition profile 7/7] together prefill 4096+0 on 112 SMs, decode B=64 ctx=2048 on 20: \
prefill 58.89 ms, decode step 14.97 ms  (elapsed 0 s)
"""


def _step(age_s: float, ms: float, *, decodes: int = 0, prefill: int = 0, split: bool = False):
    return {
        "on_split": split,
        "num_decodes": decodes,
        "decode_context_tokens": decodes * 1024,
        "num_prefill_tokens": prefill,
        "prefill_context_tokens": 0,
        "prefill_attention_pairs": prefill * (prefill + 1) / 2,
        "device_ms": ms,
        "sms": 112 if split and prefill else (20 if split else 0),
        "other_sms": 20 if split and prefill else (112 if split else 0),
        "age_s": age_s,
    }


def test_replay_writes_old_and_new_mape_per_kind(tmp_path: Path) -> None:
    (tmp_path / "server-tiny.log").write_text(LOG)
    steps = [_step(10.0 - 0.01 * i, 3.0 + 0.01 * i, decodes=16) for i in range(40)]
    for i, tokens in enumerate((8192, 150, 12000, 200, 9000, 160)):
        age = 5.0 - 0.5 * i
        steps.append(_step(age, 20.0 + tokens / 60, prefill=tokens, split=True))
        steps.append(_step(age - 0.001, 9.0 + 0.1 * i, decodes=16, split=True))
    trace = tmp_path / "tiny-mixed-auto.steps.json"
    trace.write_text(json.dumps({"steps": steps}))
    results = tmp_path / "partition-x.json"
    results.write_text(json.dumps({"git_revision": "abc1234", "device": "GPU", "date": "d"}))
    out = tmp_path / "replay.json"
    cost_replay.main([str(trace), "--old-rev", "HEAD", "--source", str(results), "--out", str(out)])
    rec = json.loads(out.read_text())
    assert rec["old_rev"] == "HEAD" and rec["new_rev"]
    assert rec["sources"] == [
        {"file": "partition-x.json", "git_revision": "abc1234", "device": "GPU", "date": "d"}
    ]
    run = rec["runs"][f"{tmp_path.name}/tiny"]
    assert run["decode/alone"]["n"] == 40
    assert run["prefill/concurrent"]["n"] == 6 and run["decode/concurrent"]["n"] == 6
    for kind in ("decode/alone", "prefill/concurrent", "decode/concurrent"):
        assert 0.0 <= run[kind]["new_mape"] and 0.0 <= run[kind]["old_mape"]
    # Split prefills with a fixed cost, short and long interleaved: the working tree's model
    # is no worse than HEAD's (the same model once committed) ...
    pc = run["prefill/concurrent"]
    assert pc["new_mape"] <= pc["old_mape"] + 1e-12
    # ... and the affine correction follows a fixed cost plus a slope where one factor per
    # split could not: the model before 5a013c9 read 296 % here (`--old-rev 8c86337`), the
    # affine one 39 % (its first readings, before the line has two points to fit).
    assert pc["new_mape"] < 0.6
