"""Replay a server's recorded steps through the partition cost model: MAPE per kind, old vs new.

    python -m bench.cost_replay DIR/qwen2.5-3b-*.steps.json [--fit OTHER/*.steps.json ...]

CPU only. Input: the `*.steps.json` files `bench/gpu_serving.py` saves (the engine's step
trace) with the server's log beside them (`server-<model>.log`, as in the serving tarballs).
Files of one directory and model are one server run: their traces overlap and are deduplicated
(and ordered by time: the file's mtime minus each step's `age_s`). Per run the model is rebuilt
as the server had it: the start-up partition profile's points and the calibrated JCT line from
the log (a run whose log has no profile, because it loaded a cached one, takes the profile of
another given run of the same model, and says so). Then every step the split executor feeds
the cost model is replayed in order, scored before it refines (as `CostModel.observe`):
  decode alone       whole-GPU decode-only steps
  decode concurrent  decode steps on a split (beside a prefill in flight)
  prefill concurrent a split's prefill; its neighbour is the mean of the split decode steps
                     that ended within its span (what the executor now passes to `observe`).
The old model is `runtime/partition/cost_model.py` at `--old-rev` (git), the new one the
working tree's. `--fit`: runs whose split prefills fit the new model's interference slope
(`CostModel.fit_interference`) before the test runs are replayed (hold out honestly: fit on
another day); without it the built-in default is used.

What the records lack (so it is inferred here): the split's SM counts before the trace had
`sms` / `other_sms` (taken from the log's `auto split: N prefill SMs` lines, default
--split-sms), the cost model's own per-step prediction (since 2026-12-06 a split prefill's
row carries the controller's, `split_predicted_ms`, made when it chose the split), and which
decode steps overlapped a split prefill (matched by time). The JCT
model is held at its start-up calibration (the server refits it online).
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

PF = re.compile(
    r"\[partition profile \d+/\d+\] prefill\s+tokens=\s*(\d+) ctx=\s*(\d+) on\s+(\d+) SMs:"
    r"\s+([\d.]+) ms"
)
DC = re.compile(
    r"\[partition profile \d+/\d+\] decode\s+batch=\s*(\d+) ctx=\s*(\d+) on\s+(\d+) SMs:"
    r"\s+([\d.]+) ms"
)
TG = re.compile(
    r"together prefill (\d+)\+(\d+) on (\d+) SMs, decode B=(\d+) ctx=(\d+) on (\d+): "
    r"prefill ([\d.]+) ms, decode step ([\d.]+) ms"
)
JCT = re.compile(r"JCTModel\(a_s=([\d.e+-]+), b_s_per_token=([\d.e+-]+), k_s_per_pair=([\d.e+-]+)")
SPLIT = re.compile(r"auto split: (\d+) prefill SMs")
TOTAL_SMS = re.compile(r"\[partition profile\] .*\((\d+) SMs\)")
KINDS = ("decode/alone", "decode/concurrent", "prefill/concurrent")


@dataclass
class Run:
    name: str
    log: str
    steps: list[dict[str, Any]]
    profile: list[tuple] = field(default_factory=list)
    jct: tuple[float, float, float] | None = None
    split_sms: int = 112
    total_sms: int = 132
    note: str = ""


def _slug(path: str) -> str:
    base = os.path.basename(path)
    for logf in glob.glob(os.path.join(os.path.dirname(path) or ".", "server-*.log")):
        s = os.path.basename(logf)[len("server-") : -len(".log")]
        if base.startswith(s + "-"):
            return s
    return base.split(".steps.json")[0]


def load_runs(paths: list[str], default_split: int, pool: list[Run] | None = None) -> list[Run]:
    groups: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for p in paths:
        groups[(os.path.dirname(os.path.abspath(p)), _slug(p))].append(p)
    runs = []
    for (d, slug), files in sorted(groups.items()):
        seen: dict[tuple, dict[str, Any]] = {}
        for f in sorted(files):
            mtime = os.path.getmtime(f)
            with open(f) as fh:
                for s in json.load(fh)["steps"]:
                    if s.get("device_ms") is None:
                        continue
                    key = (
                        s["device_ms"],
                        s["num_decodes"],
                        s["num_prefill_tokens"],
                        s["decode_context_tokens"],
                        s["on_split"],
                    )
                    seen.setdefault(key, dict(s, t=mtime - s["age_s"]))
        log_path = os.path.join(d, f"server-{slug}.log")
        text = open(log_path).read() if os.path.exists(log_path) else ""
        run = Run(f"{os.path.basename(d)}/{slug}", log_path, sorted(seen.values(), key=_t))
        _parse_log(run, text, default_split)
        runs.append(run)
    for r in runs:  # a cached profile: borrow one of the same model
        if not r.profile:
            same = [
                o
                for o in [*runs, *(pool or [])]
                if o.profile and o.name.split("/")[1] == r.name.split("/")[1]
            ]
            if same:
                r.profile, r.note = same[0].profile, f"profile borrowed from {same[0].name}"
    return runs


def _t(s: dict[str, Any]) -> float:
    return s["t"]


def _parse_log(run: Run, text: str, default_split: int) -> None:
    for t, c, sms, ms in PF.findall(text):
        run.profile.append(("prefill", int(t), int(c), int(sms), float(ms), 0, None))
    for b, c, sms, ms in DC.findall(text):
        run.profile.append(("decode", int(b), int(c), int(sms), float(ms), 0, None))
    for t, c, ps, b, dc, ds, pms, dms in TG.findall(text):
        run.profile.append(("prefill", int(t), int(c), int(ps), float(pms), int(ds), None))
        run.profile.append(("decode", int(b), int(dc), int(ds), float(dms), int(ps), None))
    calibrated = [ln for ln in text.splitlines() if "JCT model" in ln and "JCTModel(" in ln]
    if calibrated:
        m = JCT.search(calibrated[-1])
        if m:
            run.jct = tuple(float(x) for x in m.groups())  # type: ignore[assignment]
    splits = collections.Counter(int(x) for x in SPLIT.findall(text))
    run.split_sms = splits.most_common(1)[0][0] if splits else default_split
    tot = TOTAL_SMS.search(text)
    run.total_sms = int(tot.group(1)) if tot else 132


def load_module(rev: str | None) -> ModuleType:
    """runtime/partition/cost_model.py at git `rev` (None: the working tree's)."""
    if rev is None:
        from runtime.partition import cost_model

        return cost_model
    src = subprocess.run(
        ["git", "show", f"{rev}:runtime/partition/cost_model.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    tmp = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    tmp.write(src)
    tmp.close()
    spec = importlib.util.spec_from_file_location(f"cost_model_{rev}", tmp.name)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def build(cm: ModuleType, run: Run) -> Any:
    samples = []
    for stage, x, c, sms, ms, other, _ in run.profile:
        if stage == "prefill":
            shape = cm.PrefillShape.from_seqs([(c, x)])
        else:
            shape = cm.DecodeShape(x, x * c)
        samples.append(cm.ProfileSample(stage, shape, sms, ms, other))
    m = cm.CostModel.fit(run.total_sms, samples)
    if run.jct is not None:
        a, b, k = run.jct
        m.whole_prefill_ms = lambda s: (a + b * s.num_tokens + k * s.attention_pairs) * 1e3
    return m


def events(cm: ModuleType, run: Run) -> list[tuple]:
    """(kind, stage, shape, sms, other_sms, measured_ms, neighbour) in time order."""
    steps, split, total = run.steps, run.split_sms, run.total_sms
    out = []
    for s in steps:
        ms = s["device_ms"]
        # Traces since the step records carried them name the partition; older ones do not.
        sms, other = s.get("sms") or 0, s.get("other_sms") or 0
        if s["num_prefill_tokens"] == 0 and s["num_decodes"] > 0:
            d = cm.DecodeShape(s["num_decodes"], s["decode_context_tokens"])
            if s["on_split"]:
                d_sms, p_sms = (sms, other) if sms else (total - split, split)
                out.append(("decode/concurrent", "decode", d, d_sms, p_sms, ms, None))
            else:
                out.append(("decode/alone", "decode", d, total, 0, ms, None))
        elif s["on_split"] and s["num_prefill_tokens"] > 0 and s["num_decodes"] == 0:
            p = cm.PrefillShape(s["num_prefill_tokens"], s["prefill_attention_pairs"])
            t0 = s["t"] - ms / 1e3
            beside = [
                x
                for x in steps
                if x["on_split"] and x["num_decodes"] > 0 and t0 - 0.05 <= x["t"] <= s["t"] + 0.05
            ]
            nb = None
            if beside:
                nb = cm.DecodeShape(
                    round(np.mean([x["num_decodes"] for x in beside])),
                    round(np.mean([x["decode_context_tokens"] for x in beside])),
                )
            p_sms, d_sms = (sms, other or total - sms) if sms else (split, total - split)
            out.append(("prefill/concurrent", "prefill", p, p_sms, d_sms, ms, nb))
    return out


def replay(cm: ModuleType, run: Run, nu: float | None) -> dict[str, float | int]:
    m = build(cm, run)
    if nu is not None and hasattr(m, "interference"):
        m.interference["prefill"] = nu
    errs: dict[str, list[float]] = collections.defaultdict(list)
    for kind, stage, shape, sms, other, ms, nb in events(cm, run):
        if hasattr(m, "interference"):
            e = m.observe(stage, shape, sms, ms, other, neighbour=nb)
        else:
            e = m.observe(stage, shape, sms, ms, other)
        errs[kind].append(e)
    out: dict[str, float | int] = {}
    for k in KINDS:
        out[k] = float(np.mean(errs[k])) if errs[k] else float("nan")
        out[f"n_{k}"] = len(errs[k])
    return out


def fit_nu(cm: ModuleType, runs: list[Run]) -> float:
    """The interference slope fitted on `runs` (their split prefills, each run's level its own:
    `cost_model.interference_slope`)."""
    groups = []  # per run: (log measured/predicted without the term, neighbour ms)
    for run in runs:
        m = build(cm, run)
        lr, xs = [], []
        for _kind, stage, shape, sms, other, ms, nb in events(cm, run):
            if stage != "prefill" or nb is None:
                continue
            pred = m.predict(stage, shape, sms, other)
            lr.append(np.log(ms / pred))
            xs.append(m.neighbour_ms(stage, sms, other, nb))
        if len(lr) >= 2:
            groups.append((np.array(lr), np.array(xs)))
    if not groups:
        return cm.DEFAULT_PREFILL_INTERFERENCE_PER_MS
    return cm.interference_slope(groups)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("steps", nargs="+", help="*.steps.json of the runs to test on")
    ap.add_argument("--fit", nargs="*", default=[], help="*.steps.json of runs to fit nu on")
    ap.add_argument("--old-rev", default="0475b77", help="git revision of the old model")
    ap.add_argument("--split-sms", type=int, default=112, help="when the log names no split")
    ap.add_argument(
        "--source",
        action="append",
        default=[],
        help="a results JSON whose step traces these are (repeatable): its git revision, "
        "device and date go into --out",
    )
    ap.add_argument("--out", help="write the MAPEs per run and kind here (JSON)")
    args = ap.parse_args(argv)
    old, new = load_module(args.old_rev), load_module(None)
    nu = None
    fit_runs = load_runs(args.fit, args.split_sms) if args.fit else []
    test_runs = load_runs(args.steps, args.split_sms, fit_runs)
    fit_runs = load_runs(args.fit, args.split_sms, test_runs) if args.fit else []
    if args.fit:
        nu = fit_nu(new, fit_runs)
        print(f"interference slope fitted on {len(args.fit)} files: {nu:.4f} per ms")
    else:
        print(f"interference slope: default {new.DEFAULT_PREFILL_INTERFERENCE_PER_MS} per ms")
    out: dict[str, Any] = {
        "command": "python -m bench.cost_replay "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "note": "replay over recorded steps (CPU), not a live figure; traces not committed",
        "old_rev": args.old_rev,
        "new_rev": _head(),
        "interference_per_ms": nu if nu is not None else new.DEFAULT_PREFILL_INTERFERENCE_PER_MS,
        "sources": [_source(p) for p in args.source],
        "runs": {},
    }
    print(f"{'run':32s} {'kind':20s} {'n':>5s} {'old MAPE':>9s} {'new MAPE':>9s}")
    for run in test_runs:
        if not run.profile:
            print(f"{run.name}: no partition profile in {run.log}; skipped")
            continue
        a, b = replay(old, run, None), replay(new, run, nu)
        rec: dict[str, Any] = {"note": run.note} if run.note else {}
        for k in KINDS:
            print(f"{run.name:32s} {k:20s} {b[f'n_{k}']:5d} {100 * a[k]:8.1f}% {100 * b[k]:8.1f}%")
            if b[f"n_{k}"]:
                rec[k] = {"n": b[f"n_{k}"], "old_mape": a[k], "new_mape": b[k]}
        out["runs"][run.name] = rec
        if run.note:
            print(f"{'':32s} ({run.note}; split {run.split_sms} SMs)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
            fh.write("\n")


def _head() -> str:
    """The working tree's revision (with "+dirty" when it differs): the new model's."""
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return f"{rev}+dirty" if dirty else rev


def _source(path: str) -> dict[str, Any]:
    with open(path) as fh:
        src = json.load(fh)
    return {"file": os.path.basename(path)} | {
        k: src.get(k) for k in ("git_revision", "device", "date")
    }


if __name__ == "__main__":
    main()
