"""Issue 6's serving comparison over HTTP, on one device, under one hard deadline.

Starts `python3 -m app serve` as a child process per model, then drives it with the benchmark
harness (`bench.serve`, `bench.compare` in one-server mode: settings switched through the admin
API, prefix cache reset before every run/side) and merges everything into one results JSON:

  screen      best static split: a short fixed-QPS run per candidate split (skipped with
              --static-split N)
  <workload>  for long-data, mixed, arxiv: `bench.serve --find-max-qps --slo ...` with the
              server set to `off`, `auto` and the best static split in turn (policy fcfs);
              max QPS meeting the P99 TTFT + TPOT SLO, TTFT / TBT (= ITL) mean and P99
  score-chat  scoring QPS at a P99 SLO (post-recommendation, or --score-workload) while a chat
              stream runs in the background, auto vs off
  ablation    bench.compare at one QPS on `mixed`: policy alone (fcfs vs srjf, partition
              off), partition alone (off vs auto, fcfs), both (off+fcfs vs auto+srjf)

Every part is timed against an estimate: a part that would overrun the deadline is skipped and
recorded as skipped (with the reason); every part is in try/except with its error recorded; the
JSON is rewritten after each part (a call killed at its limit still leaves the parts done).

`--smoke` (CPU, random:tiny, `--partition off`): the sides switch policies instead of
partitions and every run is a few requests; it proves the plumbing, not performance.

    python3 -m bench.gpu_serving --models random:qwen2.5-3b --rev abc123 --deadline-s 360 \\
        --out-dir $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

from bench.workloads import SPECS

WORKLOADS = ("long-data", "mixed", "arxiv")
DEFAULT_PARTS = ("screen", "long-data", "mixed", "score-chat", "ablation", "arxiv")


class Budget:
    """Wall-clock deadline shared by every part (time.monotonic seconds)."""

    def __init__(self, deadline_s: float) -> None:
        self.t_end = time.monotonic() + deadline_s

    def left_s(self) -> float:
        return self.t_end - time.monotonic()


# ------------------------------------------------------------------------- configuration


def sides_for(smoke: bool, static_sms: int | None) -> dict[str, str]:
    """Settings of the compared modes, as bench.compare's `key=value` strings.

    Smoke (CPU, partition off): policies stand in for partition modes, so that the admin
    switches, the per-side bookkeeping and the ratios are exercised without green contexts."""
    if smoke:
        return {"off": "policy=fcfs", "auto": "policy=srjf", "static": "policy=spf"}
    sides = {"off": "partition=off,policy=fcfs", "auto": "partition=auto,policy=fcfs"}
    if static_sms is not None:
        sides["static"] = f"partition=static:{static_sms},policy=fcfs"
    return sides


def ablation_pairs(smoke: bool) -> dict[str, tuple[str, str]]:
    if smoke:
        return {
            "policy_alone": ("policy=fcfs", "policy=srjf"),
            "partition_alone": ("policy=fcfs", "policy=spf"),
            "both": ("policy=fcfs", "policy=srjf-oneshot"),
        }
    return {
        "policy_alone": ("partition=off,policy=fcfs", "partition=off,policy=srjf"),
        "partition_alone": ("partition=off,policy=fcfs", "partition=auto,policy=fcfs"),
        "both": ("partition=off,policy=fcfs", "partition=auto,policy=srjf"),
    }


# ------------------------------------------------------------------------- HTTP helpers


def http_json(
    url: str, method: str = "GET", body: dict | None = None, timeout_s: float = 10.0
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    token = os.environ.get("GREENLANE_ADMIN_TOKEN")
    if token and "/admin/" in url:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read().decode() or "null")


def apply_settings(base_url: str, settings: str) -> dict[str, Any]:
    """PUT each change of a `key=value,...` settings string; returns what the server reports
    after the last one (an HTTP error raises: measuring the wrong mode is worse than none)."""
    from bench.compare import _state_summary, parse_settings

    state: dict[str, Any] = {}
    for change in parse_settings(settings):
        state = http_json(base_url + change.path, "PUT", change.body)
    return _state_summary(state)


def reset_cost_model_errors(base_url: str) -> bool:
    """Empty the server's cost-model error logs before a side (`POST
    /admin/api/cost-model/errors/reset`): the logs are the server's, so until the twenty-fifth
    session each side's `cost_model_errors_at_end` also held the sides that ran before it.
    False where the server keeps none (no green contexts, an older server): then that
    reading spans the sides as before."""
    try:
        http_json(base_url + "/admin/api/cost-model/errors/reset", "POST", {})
    except Exception:  # noqa: BLE001 - the side's latencies are still worth measuring
        return False
    return True


def engine_counters(base_url: str) -> dict[str, Any]:
    """What the engine says of how it ran (for one side's run: read before and after, then
    `engine_during`): the TBT cut's mixed steps and auto's choices ({} if unreadable)."""
    try:
        st = http_json(base_url + "/admin/api/state")
    except Exception:  # noqa: BLE001 - the run is still worth its latencies
        return {}
    return {
        "tbt_cut": (st.get("prefill") or {}).get("tbt_cut") or {},
        "choice_counts": (st.get("partition") or {}).get("choice_counts") or {},
        "cost_model_errors": (st.get("cost_model") or {}).get("errors"),
        "gc": st.get("gc") or {},
        "kernels_compiled": (st.get("engine") or {}).get("kernels_compiled_while_serving"),
        # Requests preempted (their KV recomputed later) and scoring prompts chunked: counters.
        "num_preemptions": (st.get("engine") or {}).get("num_preemptions"),
        "num_chunked_scoring": (st.get("engine") or {}).get("num_chunked_scoring"),
        "num_layer_sliced_prefills": (st.get("engine") or {}).get("num_layer_sliced_prefills"),
        "num_sub_layer_sliced_prefills": (st.get("engine") or {}).get(
            "num_sub_layer_sliced_prefills"
        ),
    }


def engine_during(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The counters of `engine_counters` over one run (after - before); the rest as after."""
    if not after:
        return {"unreadable": True}
    cut_b, cut_a = before.get("tbt_cut") or {}, after["tbt_cut"]
    out = {
        k: (v - cut_b.get(k, 0) if k.startswith("num_") and isinstance(v, int) else v)
        for k, v in cut_a.items()
    }
    choices_b = before.get("choice_counts") or {}
    choices = {k: v - choices_b.get(k, 0) for k, v in after["choice_counts"].items()}
    gc_b, gc_a = before.get("gc") or {}, after.get("gc") or {}
    gc_during = {
        k: (v - (gc_b.get(k) or 0) if isinstance(v, int | float) and k.startswith("full") else v)
        for k, v in gc_a.items()
    }

    def during(key: str) -> int | None:
        b, a = before.get(key), after.get(key)
        return None if a is None or b is None else a - b

    return {
        "tbt_cut": out,
        "choice_counts": {k: v for k, v in choices.items() if v},
        "cost_model_errors_at_end": after.get("cost_model_errors"),
        "gc": gc_during,
        # Triton variants compiled during the run (first uses on the engine thread; None: the
        # server does not count them, e.g. on a CPU).
        "kernels_compiled": during("kernels_compiled"),
        "num_preemptions": during("num_preemptions"),
        "num_chunked_scoring": during("num_chunked_scoring"),
        "num_layer_sliced_prefills": during("num_layer_sliced_prefills"),
        "num_sub_layer_sliced_prefills": during("num_sub_layer_sliced_prefills"),
    }


def step_gaps(
    base_url: str,
    over_ms: tuple[float, ...] = (50.0, 80.0, 100.0),
    save_to: Path | None = None,
) -> dict[str, Any]:
    """What decodes waited per step over the last steps the engine kept (/admin/api/steps, up
    to 4,096: the end of a side's search, i.e. its highest rates), by kind of step: waited =
    the device idle before the step (the host's gap) + its device time. Says which steps make
    the gaps between tokens that exceed a target ({"unreadable": True} if the server keeps no
    trace). `save_to`: also write the steps there (for `python -m bench.step_fit`)."""
    try:
        steps = http_json(base_url + "/admin/api/steps?limit=4096")["steps"]
    except Exception:  # noqa: BLE001 - the run is still worth its latencies
        return {"unreadable": True}
    out = summarize_steps(steps, over_ms)
    if save_to is not None:
        save_to.write_text(json.dumps({"steps": steps}))
        out["file"] = save_to.name
    return out


STEP_TOKEN_BOUNDS = (512, 1024, 2048, 4096, 8192)


def summarize_steps(
    steps: list[dict[str, Any]], over_ms: tuple[float, ...] = (50.0, 80.0, 100.0)
) -> dict[str, Any]:
    """`step_gaps` on a list of steps (runtime.engine.STEP_TRACE_FIELDS, with age_s)."""

    def kind(st: dict[str, Any]) -> str:
        where = "split " if st["on_split"] else ""
        if st["num_decodes"] and st["num_prefill_tokens"]:
            return where + "mixed"
        return where + ("decode" if st["num_decodes"] else "prefill")

    def waited(st: dict[str, Any]) -> float | None:
        if st["device_ms"] is None:
            return None
        return st["device_ms"] + (st["idle_before_ms"] or 0.0)

    by_kind: dict[str, list[dict[str, Any]]] = {}  # the timed steps of each kind
    for st in steps:
        if st["device_ms"] is not None:
            by_kind.setdefault(kind(st), []).append(st)

    def q(xs: list[float], p: float) -> float:
        return round(xs[min(len(xs) - 1, int(p * len(xs)))], 2)

    kinds = {}
    for k, sts in sorted(by_kind.items()):
        xs = sorted(waited(st) or 0.0 for st in sts)
        kinds[k] = {
            "num_steps": len(xs),
            # Device time alone (the GPU's share of the wait) and the prefill tokens the kind
            # carried per step: what a mixed step adds over a decode-only one.
            "device_ms_mean": round(sum(st["device_ms"] for st in sts) / len(xs), 3),
            "prefill_tokens_mean": round(sum(st["num_prefill_tokens"] for st in sts) / len(xs), 1),
            "waited_ms_mean": round(sum(xs) / len(xs), 3),
            "waited_ms_p50": q(xs, 0.5),
            "waited_ms_p90": q(xs, 0.9),
            "waited_ms_p99": q(xs, 0.99),
            "waited_ms_max": round(xs[-1], 2),
            **{f"num_over_{t:g}_ms": sum(1 for x in xs if x > t) for t in over_ms},
        }
    # Split executor (auto, static): what continuing decodes waited between their steps, on
    # the device (`decode_gap_ms`: a layer slice or a prefill on their stream, the host).
    gaps = sorted(st["decode_gap_ms"] for st in steps if st.get("decode_gap_ms") is not None)
    decode_gaps = (
        {
            "num": len(gaps),
            "p50": q(gaps, 0.5),
            "p99": q(gaps, 0.99),
            "max": round(gaps[-1], 2),
            **{f"num_over_{t:g}_ms": sum(1 for x in gaps if x > t) for t in over_ms},
        }
        if gaps
        else None
    )
    # Split executor: prefills run in layer slices, their span (decode steps between slices
    # included) against the controller's prediction (`prefill/layer_sliced`'s readings);
    # ratio = measured / predicted, as the cost model's `ratio_p50_<kind>`.
    pairs = [
        (st["layer_sliced_span_ms"], st["layer_sliced_predicted_ms"])
        for st in steps
        if st.get("layer_sliced_span_ms") is not None and st.get("layer_sliced_predicted_ms")
    ]
    ratios = sorted(span / pred for span, pred in pairs)
    layer_sliced = (
        {
            "num": len(pairs),
            "span_ms_mean": round(sum(span for span, _ in pairs) / len(pairs), 2),
            "ratio_p10": round(ratios[int(0.1 * (len(ratios) - 1))], 3),
            "ratio_p50": round(ratios[int(0.5 * (len(ratios) - 1))], 3),
            "ratio_p90": round(ratios[int(0.9 * (len(ratios) - 1))], 3),
        }
        if pairs
        else None
    )
    with_decodes = [st for st in steps if st["num_decodes"] and waited(st) is not None]
    longest = sorted(with_decodes, key=lambda st: -(waited(st) or 0.0))[:8]
    return {
        "num_steps": len(steps),
        "span_s": round(steps[0]["age_s"] - steps[-1]["age_s"], 2) if steps else 0.0,
        "by_kind": kinds,
        "decode_gap_ms": decode_gaps,
        "layer_sliced": layer_sliced,
        # Steps by the tokens they ran (prefill + one a decode), over each bound. vLLM has no
        # counterpart: its tokens-per-iteration histogram counts a whole prompt in the
        # iteration its prefill ends, not the chunk each step ran.
        "num_steps_over_tokens": {
            str(b): sum(1 for st in steps if st["num_prefill_tokens"] + st["num_decodes"] > b)
            for b in STEP_TOKEN_BOUNDS
        },
        "longest_with_decodes": [
            {"kind": kind(st), "waited_ms": round(waited(st) or 0.0, 2), **st} for st in longest
        ],
    }


def step_gaps_by_probe(record: dict[str, Any], probe_dir: Path) -> dict[str, Any]:
    """`summarize_steps` of each probe's own trace (`bench.serve --save-steps`), keyed by the
    probe's QPS like `max_qps_view`'s probes, with how much of the probe the trace spans (a
    busy server's 4,096 steps can be fewer seconds than the probe took)."""
    out: dict[str, Any] = {}
    for run in record.get("runs") or []:
        saved = run.get("steps") or {}
        if not saved.get("saved"):
            continue
        try:
            steps = json.loads((probe_dir / saved["file"]).read_text())["steps"]
        except (OSError, ValueError, KeyError):
            continue
        summary = summarize_steps(steps)
        summary.pop("longest_with_decodes")  # (in the file; the record keeps the by-kind view)
        out[str(float(run["qps"]))] = {
            **summary,
            "file": saved["file"],
            "covers_probe": saved.get("covers_run"),
        }
    return out


def disabled_splits(base_url: str) -> set[str]:
    """Splits the server has taken out of service so far (empty if the state is unreadable)."""
    try:
        part = http_json(base_url + "/admin/api/state").get("partition") or {}
    except Exception:  # noqa: BLE001 - mode_drift says so after the run
        return set()
    return set(part.get("disabled_splits") or {})


def mode_drift(
    base_url: str, applied: dict[str, Any], disabled_before: set[str] | None = None
) -> str | None:
    """Why the server no longer runs the mode a run was started in (None: it still does). The
    engine may take a failing split out of service mid-run (a pin then falls back to `off`):
    such a run measured a mix of modes and must not be credited to the one applied. Splits
    already disabled when the run began (`disabled_before`, e.g. at start-up) are no drift."""
    try:
        state = http_json(base_url + "/admin/api/state")
    except Exception as exc:  # noqa: BLE001 - cannot tell: say so
        return f"state unreadable after the run: {type(exc).__name__}: {exc}"
    part = state.get("partition") or {}
    want = (applied.get("partition") or {}).get("mode")
    if want and part.get("mode") != want:
        return f"partition mode changed during the run: {want} -> {part.get('mode')}"
    new = sorted(set(part.get("disabled_splits") or {}) - (disabled_before or set()))
    if new:
        return f"splits disabled during the run: {new}"
    return None


def wait_healthy(url: str, deadline_s: float, proc: subprocess.Popen) -> None:
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {deadline_s:.0f} s")


class Server:
    """`python3 -m app serve` in a child process, killed on exit (log kept in the out dir)."""

    def __init__(
        self, model: str, port: int, extra: list[str], log_path: Path, tree: Path | None = None
    ) -> None:
        """`tree`: serve that checkout's code (an older revision for an A/B), run from its
        root with it first on PYTHONPATH; None: this one."""
        self.tree = tree
        self.cmd = [
            sys.executable,
            "-m",
            "app",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            *extra,
        ]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        t0 = time.perf_counter()
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = None
        if self.tree is not None:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(self.tree), env.get("PYTHONPATH", "")) if p
            )
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.tree, env=env
        )
        try:
            wait_healthy(self.url + "/health", timeout_s, self.proc)
        except Exception:
            self.stop()
            raise
        return time.perf_counter() - t0

    def log_tail(self, n_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if getattr(self, "_log", None) is not None:
            self._log.close()


# ------------------------------------------------------------------------- harness runs


def prime_args(workload: str) -> list[str]:
    """bench.serve's priming for a workload whose users keep arriving (`user_turnover`): its
    first users' profiles are cached after each probe's prefix-cache reset, so a probe runs
    the steady stream of new users' cold profiles, not all of them cold at its start."""
    spec = SPECS.get(workload)
    return ["--prime-prefixes"] if spec is not None and spec.user_turnover else []


def run_harness(module: str, args: list[str], timeout_s: float) -> dict[str, Any]:
    """One harness subprocess; returns its JSON (args must hold --out) plus rc and wall time."""
    out = Path(args[args.index("--out") + 1])
    cmd = [sys.executable, "-m", module, *args, "--no-progress"]
    t0 = time.perf_counter()
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, timeout_s))
    entry: dict[str, Any] = {
        "cmd": " ".join(["python3", "-m", module, *args]),
        "rc": cp.returncode,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if cp.returncode != 0 or not out.exists():
        entry["stderr_tail"] = (cp.stderr or "")[-2000:]
        raise RuntimeError(f"{module} rc={cp.returncode}: {(cp.stderr or '')[-400:]}")
    entry["record"] = json.loads(out.read_text())
    return entry


def latency_view(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """TTFT / TBT / TPOT mean, P50 and P99 (ms) of one run. TBT = inter-token gaps (ITL)."""
    if not metrics:
        return None

    def pick(key: str) -> dict[str, Any]:
        m = metrics.get(key) or {}
        return {"mean": m.get("mean"), "p50": m.get("median"), "p99": m.get("p99")}

    return {
        "completed": metrics.get("completed"),
        "failed": metrics.get("failed"),
        "request_throughput": metrics.get("request_throughput"),
        "output_throughput": metrics.get("output_throughput"),
        "total_token_throughput": metrics.get("total_token_throughput"),
        "ttft_ms": pick("ttft_ms"),
        "tbt_ms": pick("itl_ms"),
        "tpot_ms": pick("tpot_ms"),
        "slo_attainment": metrics.get("slo_attainment"),
    }


def background_chat_view(path: Path) -> dict[str, Any]:
    """The background chat's latencies over a whole score+chat side (its harness was stopped
    by SIGTERM after the scoring search and wrote what completed)."""
    try:
        record = json.loads(path.read_text())
        (run,) = record["runs"]
    except (OSError, ValueError, KeyError) as exc:
        return {"error": f"no background chat record: {type(exc).__name__}: {exc}"[:300]}
    view = latency_view(run.get("metrics")) or {}
    view["stopped_by_signal"] = record.get("stopped_by_signal")
    view["file"] = path.name
    return view


def chat_by_probe(
    chat_run: dict[str, Any], score_runs: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The background chat's latencies per scoring probe, keyed like `max_qps_view`'s probes.

    A probe gets the chat requests (`chat_run["requests"]`, from `bench.serve
    --record-requests`) sent inside its wall-clock window (its metrics' `started_unix_s` ..
    `ended_unix_s`): each request counts once, under the scoring load it started into, and
    those sent between probes count for none. TBT = the pooled inter-token gaps of those
    requests (ITL). Figures are None for a probe without completed chat requests."""
    from bench.metrics import summarize_ms, token_gaps

    by_probe: dict[str, dict[str, Any]] = {}
    for run in score_runs:
        start_s, end_s = run["metrics"]["started_unix_s"], run["metrics"]["ended_unix_s"]
        sent = [r for r in chat_run["requests"] if start_s <= r["start_unix_s"] < end_s]
        ok = [r for r in sent if r["ok"]]
        ttft = summarize_ms([r["ttft_s"] for r in ok])
        tbt = summarize_ms([gap for r in ok for gap in r["itl_s"]])
        tpot = summarize_ms([r["tpot_s"] for r in ok if r["tpot_s"] is not None])
        by_probe[str(run["qps"])] = {
            "completed": len(ok),
            "failed": len(sent) - len(ok),
            "ttft_ms": {"p99": ttft["p99"]},
            "tbt_ms": {"p50": tbt["median"], "p99": tbt["p99"]},
            "tpot_ms": {"p99": tpot["p99"]},
        }
        # The server's own gaps in the probe (every stream it ran: here the background chat),
        # as its API server received them: what the engine and its hop already had.
        by_probe[str(run["qps"])]["server_itl"] = run.get("server_itl")
        # The same gaps shared by the tokens each chunk carried (a token without text sends no
        # chunk: at ~55-ms gaps between layer slices one such token reads as a 110-ms gap).
        per_token = [g for r in ok for g in token_gaps(r["itl_s"], r.get("itl_tokens") or [])]
        if per_token:
            tok = summarize_ms(per_token)
            by_probe[str(run["qps"])]["token_tbt_ms"] = {"p50": tok["median"], "p99": tok["p99"]}
    return by_probe


def background_chat_by_probe(chat_path: Path, score_path: Path) -> dict[str, Any] | None:
    """`chat_by_probe` of a background chat's and a scoring search's files; None when the
    chat record is unreadable (`background_chat_view` says why)."""
    try:
        (chat_run,) = json.loads(chat_path.read_text())["runs"]
        score_runs = json.loads(score_path.read_text())["runs"]
    except (OSError, ValueError, KeyError):
        return None
    return chat_by_probe(chat_run, score_runs)


def add_chat_at_common_qps(sc: dict[str, Any]) -> None:
    """(Re)compute each score+chat side's `chat_at_common_qps`: its chat figures at the highest
    scoring QPS that every side with per-probe chat figures probed (the searches probe
    different rates, and the whole-run chat figures mix them); with two sides or more, their
    chat P99 ITL there (`chat_p99_itl_at_common_score_qps`)."""
    sc.pop("chat_p99_itl_at_common_score_qps", None)
    sides: dict[str, dict[str, Any]] = {}
    for name, side in sc.items():
        if isinstance(side, dict) and "chat_background_by_probe" in side:
            side.pop("chat_at_common_qps", None)
            if side["chat_background_by_probe"]:
                sides[name] = side["chat_background_by_probe"]
    common = set.intersection(*(set(by_probe) for by_probe in sides.values())) if sides else set()
    if not common:
        return
    q = max(common, key=float)
    for name, by_probe in sides.items():
        sc[name]["chat_at_common_qps"] = {"qps": float(q), **by_probe[q]}
    if len(sides) >= 2:
        sc["chat_p99_itl_at_common_score_qps"] = {
            "qps": float(q),
            **{name: by_probe[q]["tbt_ms"]["p99"] for name, by_probe in sides.items()},
        }


def add_score_chat_by_probe(sc: dict[str, Any]) -> None:
    """(Re)compute `auto_by_probe` for scoring beside chat: auto against every baseline (sides
    named off*) probe by probe, on the chat's P99 gap, the scoring latency P50 and tokens/s
    (issue 13's first target, as `add_comparisons` checks it on the chat workloads)."""
    sc.pop("auto_by_probe", None)
    auto = sc.get("auto")
    if not isinstance(auto, dict) or not auto.get("probes"):
        return
    baselines = {
        k: v
        for k, v in sc.items()
        if k.startswith("off") and isinstance(v, dict) and v.get("probes")
    }
    if baselines:
        sc["auto_by_probe"] = by_probe_checks(baselines, auto)


def max_qps_view(record: dict[str, Any]) -> dict[str, Any]:
    """Max QPS, its latencies, and every probe's latencies keyed by QPS (for same-QPS ratios)."""
    search = record.get("max_qps_search") or {}
    runs = record.get("runs") or []
    by_qps = {str(r["qps"]): latency_view(r.get("metrics")) for r in runs}
    best = search.get("max_qps")
    return {
        "max_qps": best,
        "lowest_failing_qps": search.get("lowest_failing_qps"),
        "max_qps_is_lower_bound": search.get("lowest_failing_qps") is None,
        "slo": search.get("slo"),
        "at_max_qps": by_qps.get(str(best)) if best is not None else None,
        "probes": by_qps,
    }


def ladder_view(record: dict[str, Any], slos: list[str]) -> dict[str, Any]:
    """A fixed-rate ladder judged against each SLO: max QPS = the highest rate such that it
    and every lower rate meet the P99 SLO. The first SLO is the primary one."""
    from bench.metrics import SLO, meets_p99_slo

    runs = sorted(record.get("runs") or [], key=lambda r: float(r["qps"]))
    by_slo: dict[str, dict[str, Any]] = {}
    for text in slos:
        slo = SLO.parse(text)
        assert slo is not None
        best = fail = None
        for r in runs:
            if r.get("metrics") and meets_p99_slo(r["metrics"], slo):
                best = float(r["qps"])
            else:
                fail = float(r["qps"])
                break
        by_slo[text] = {"max_qps": best, "lowest_failing_qps": fail}
    probes = {str(float(r["qps"])): latency_view(r.get("metrics")) for r in runs}
    primary = by_slo[slos[0]]
    best = primary["max_qps"]
    return {
        "max_qps": best,
        "lowest_failing_qps": primary["lowest_failing_qps"],
        "max_qps_is_lower_bound": primary["lowest_failing_qps"] is None,
        "slo": slos[0],
        "by_slo": by_slo,
        "ladder": [float(r["qps"]) for r in runs],
        "at_max_qps": probes.get(str(best)) if best is not None else None,
        "probes": probes,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a, or None when either is missing or a is not positive."""
    if a is None or b is None or not a > 0:
        return None
    return b / a


def geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def compare_modes(off: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """other vs off for one workload: max-QPS ratio, and P99/mean latency ratios at the highest
    QPS both searches probed (the doubling phase probes the same rates on both sides)."""
    common = [
        q for q in off["probes"] if q in other["probes"] and off["probes"][q] and other["probes"][q]
    ]
    out: dict[str, Any] = {
        "throughput_ratio": ratio(off["max_qps"], other["max_qps"]),
        "common_qps": None,
    }
    if off.get("by_slo") and other.get("by_slo"):
        out["throughput_ratio_by_slo"] = {
            k: ratio(v["max_qps"], (other["by_slo"].get(k) or {}).get("max_qps"))
            for k, v in off["by_slo"].items()
        }
    if common:
        q = max(common, key=float)
        a, b = off["probes"][q], other["probes"][q]
        out["common_qps"] = float(q)
        for key in ("ttft_ms", "tbt_ms"):
            for stat in ("p99", "mean"):
                out[f"{stat}_{key[:-3]}_ratio"] = ratio(a[key][stat], b[key][stat])
    return out


def build_summary(models: dict[str, Any]) -> dict[str, Any]:
    """Issue 6's summary keys: geometric means over (model, workload) of auto/off ratios;
    cost_model_mape = mean of the servers' online cost-model MAPE (None where not reported)."""
    thr, tbt, ttft, per = [], [], [], {}
    for model, m in models.items():
        for wl in WORKLOADS:
            w = (m.get("workloads") or {}).get(wl) or {}
            c = w.get("auto_vs_off")
            if not c:
                continue
            per[f"{model}/{wl}"] = c
            thr.append(c.get("throughput_ratio"))
            tbt.append(c.get("p99_tbt_ratio"))
            ttft.append(c.get("p99_ttft_ratio"))
    mapes = [
        m.get("cost_model_mape")
        for m in models.values()
        if isinstance(m.get("cost_model_mape"), (int, float))
        and not math.isnan(m["cost_model_mape"])
    ]
    sc = {
        f"{model}": (m.get("score_chat") or {}).get("score_qps_ratio_auto_vs_off")
        for model, m in models.items()
        if m.get("score_chat")
    }
    return {
        "throughput_ratio_auto_vs_off": geomean(thr),
        "p99_tbt_ratio_auto_vs_off": geomean(tbt),
        "p99_ttft_ratio_auto_vs_off": geomean(ttft),
        "cost_model_mape": sum(mapes) / len(mapes) if mapes else None,
        "score_qps_ratio_auto_vs_off_with_chat": sc or None,
        # The other half of that trade: the background chat's P99 TBT over each side.
        "chat_p99_tbt_ratio_auto_vs_off_with_scoring": {
            model: m["score_chat"]["chat_p99_tbt_ratio_auto_vs_off"]
            for model, m in models.items()
            if (m.get("score_chat") or {}).get("chat_p99_tbt_ratio_auto_vs_off") is not None
        }
        or None,
        "ratios_are": "geometric mean over (model, workload) of auto/off; throughput = max "
        "QPS meeting the P99 SLO; latencies at the highest QPS both probed",
        "per_model_workload": per,
    }


# ------------------------------------------------------------------------- orchestration


class Orchestrator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.budget = Budget(args.deadline_s)
        self.out_dir = Path(args.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.smoke = args.smoke
        self.results: dict[str, Any] = {
            "command": args.command
            or " ".join(["python3", "-m", "bench.gpu_serving", *sys.argv[1:]]),
            "git_revision": args.rev,
            "device": device_name(args.smoke),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "smoke": self.smoke,
            "definitions": {
                "tbt": "inter-token latency (harness itl_ms, pooled gaps between content "
                "chunks); the SLO's TBT bound is applied to the P99 of those pooled gaps",
                "sides": "policy fcfs unless stated; off = monolithic mixed batches",
            },
            "plan": [],
            "models": {},
            "skipped": [],
            "errors": {},
            "summary": {},
        }
        self.path = self.out_dir / f"{args.tag}-{dt.date.today().isoformat()}.json"

    # -- bookkeeping
    def save(self) -> None:
        self.results["summary"] = build_summary(self.results["models"])
        self.results["left_s_at_save"] = round(self.budget.left_s(), 1)
        self.path.write_text(json.dumps(self.results, indent=1, default=str) + "\n")

    def part(self, name: str, est_s: float, fn: Any, *fa: Any) -> Any:
        """Run fn if its estimate fits in what is left; record errors; save after it."""
        left = self.budget.left_s()
        if left < est_s:
            self.results["skipped"].append(f"{name}: needs ~{est_s:.0f} s, {left:.0f} s left")
            print(f"SKIP {name} (needs ~{est_s:.0f} s, {left:.0f} s left)", flush=True)
            return None
        t0 = time.perf_counter()
        print(f"--- {name} (est {est_s:.0f} s, {left:.0f} s left)", flush=True)
        try:
            return fn(*fa)
        except Exception as exc:  # noqa: BLE001 - recorded; the next part still runs
            traceback.print_exc()
            self.results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            return None
        finally:
            print(f"--- {name} took {time.perf_counter() - t0:.1f} s", flush=True)
            self.save()

    def timeout(self, est_s: float) -> float:
        """A harness call may use twice its estimate (at least its estimate plus one request
        timeout: an overloaded run drains that long), never past the deadline."""
        want = max(2 * est_s, est_s + self.args.request_timeout_s + 10)
        return min(want, self.budget.left_s() - 3)

    # -- estimates (seconds): a run = arrivals + drain; smoke runs are request-count bound
    def run_s(self) -> float:
        return self.args.duration_s + self.args.drain_s

    def search_s(self) -> float:
        return self.args.max_probes * self.run_s()

    def ladder_s(self) -> float:
        return len(self.args.ladder.split(",")) * self.run_s() if self.args.ladder else 0.0

    def side_s(self) -> float:
        """One side of a workload comparison: the ladder when given, else the search."""
        return self.ladder_s() if self.args.ladder else self.search_s()

    def extra_slos(self) -> list[str]:
        return [x for x in (self.args.slos or "").split(";") if x]

    def plan(self, models: list[str], parts: list[str]) -> list[tuple[str, float]]:
        a = self.args
        n_sides = 2 if (a.static_split is None and "screen" not in parts and not self.smoke) else 3
        est = {
            "screen": len(a.screen_fracs.split(",")) * self.run_s(),
            "score-chat": 2 * self.search_s() + 5,
            "ablation": 3 * 2 * a.ablation_rounds * self.run_s(),
        }
        for wl in WORKLOADS:
            est[wl] = n_sides * self.side_s()
        plan = []
        for m in models:
            plan.append((f"{m}/start", a.start_s))
            plan += [(f"{m}/{p}", est[p]) for p in parts if p in est]
        return plan

    # -- parts
    def screen(self, srv: Server, rec: dict[str, Any]) -> None:
        state = http_json(srv.url + "/admin/api/state")
        part = state.get("partition") or {}
        splits = sorted(int(s) for s in part.get("splits") or [])
        if not splits:
            raise RuntimeError(f"no pre-created splits: {part.get('reason')}")
        cands = []
        for f in (float(x) for x in self.args.screen_fracs.split(",")):
            s = min(splits, key=lambda v: abs(v - f * part.get("total_sms", splits[-1])))
            if s not in cands:
                cands.append(s)
        res: dict[str, Any] = {"candidates": cands, "runs": {}}
        rec["screen"] = res
        for s in cands:
            if self.budget.left_s() < self.run_s():
                res["runs"][str(s)] = "skipped: device time"
                continue
            try:
                res["runs"][str(s)] = self.screen_one(srv, rec, s)
            except Exception as exc:  # noqa: BLE001 - one bad split must not end the screen
                res["runs"][str(s)] = f"error: {type(exc).__name__}: {exc}"[:600]
        scored = [
            (v.get("goodput") or 0.0, -(v["tbt_ms"]["p99"] or math.inf), int(k))
            for k, v in res["runs"].items()
            if isinstance(v, dict)
        ]
        if not scored:
            raise RuntimeError("no screen run finished")
        res["best"] = max(scored)[2]
        res["rule"] = "highest goodput at the screen QPS, then lowest P99 TBT"
        rec["best_static_split"] = res["best"]

    def screen_one(self, srv: Server, rec: dict[str, Any], s: int) -> dict[str, Any]:
        """One fixed-QPS long-data run with the server pinned to split `s`."""
        applied = apply_settings(srv.url, f"partition=static:{s},policy=fcfs")
        before = disabled_splits(srv.url)
        path = self.out_dir / f"{rec['slug']}-screen-{s}.json"
        e = run_harness(
            "bench.serve",
            [
                "--url",
                srv.url,
                "--workload",
                "long-data",
                "--scale",
                str(self.args.scale),
                *self.count_args(),
                "--qps",
                str(self.args.screen_qps),
                "--seed",
                "0",
                "--slo",
                self.args.slo,
                "--out",
                str(path),
            ],
            self.timeout(self.run_s()),
        )
        m = e["record"].get("metrics") or {}
        out = {
            "server_settings": applied,
            **(latency_view(m) or {}),
            "goodput": m.get("goodput"),
        }
        drift = mode_drift(srv.url, applied, before)
        if drift and "mode changed" in drift:
            raise RuntimeError(f"static:{s} did not hold ({drift}); not a candidate")
        if drift:
            out["note"] = drift
        return out

    def count_args(self) -> list[str]:
        # A request still running after --request-timeout is an SLO failure anyway; the bound
        # keeps an overloaded probe's drain from eating the device call.
        timeout = ["--request-timeout", str(self.args.request_timeout_s)]
        if self.smoke:
            return ["--num-requests", str(self.args.num_requests), *timeout]
        return ["--duration", str(self.args.duration_s), *timeout]

    def max_qps(
        self,
        srv: Server,
        rec: dict[str, Any],
        wl: str,
        side: str,
        settings: str,
        workload: str | None = None,
        slo: str | None = None,
        qps0: float | None = None,
        ladder: bool = False,
    ) -> dict[str, Any]:
        """Max QPS of one side: a doubling/bisection search at `slo`, or (ladder) every rate
        of --ladder, judged afterwards against each SLO of --slo and --slos."""
        applied = apply_settings(srv.url, settings)
        errors_reset = reset_cost_model_errors(srv.url)
        before = disabled_splits(srv.url)
        counters = engine_counters(srv.url)
        path = self.out_dir / f"{rec['slug']}-{wl}-{side}.json"
        # Each probe's steps, apart from the side's own file at the end (`step_gaps_at_end`),
        # so a glob over the side files does not count them twice.
        probe_steps = self.out_dir / "probe-steps"
        probe_steps.mkdir(exist_ok=True)
        rates = (
            ["--qps", self.args.ladder]
            if ladder
            else [
                "--qps",
                str(qps0 or self.args.start_qps),
                "--find-max-qps",
                "--max-probes",
                str(self.args.max_probes),
            ]
        )
        e = run_harness(
            "bench.serve",
            [
                "--url",
                srv.url,
                "--workload",
                workload or wl,
                "--scale",
                str(self.args.scale),
                *self.count_args(),
                *rates,
                "--seed",
                "0",
                "--slo",
                slo or self.args.slo,
                "--save-steps",
                str(probe_steps / path.stem),
                *prime_args(workload or wl),
                "--out",
                str(path),
            ],
            self.timeout(self.ladder_s() if ladder else self.search_s()),
        )
        view = (
            ladder_view(e["record"], [slo or self.args.slo, *self.extra_slos()])
            if ladder
            else max_qps_view(e["record"])
        )
        drift = mode_drift(srv.url, applied, before)
        if drift:
            view["mode_drift"] = drift  # kept, and said: the table and notes must mention it
        view.update(
            {
                "settings": settings,
                "server_settings": applied,
                "engine_during_run": engine_during(counters, engine_counters(srv.url)),
                "cost_model_errors_reset_before": errors_reset,
                "step_gaps_at_end": step_gaps(srv.url, save_to=path.with_suffix(".steps.json")),
                "step_gaps_by_probe": step_gaps_by_probe(e["record"], probe_steps),
                "file": path.name,
                "wall_s": e["wall_s"],
            }
        )
        print(
            f"{rec['slug']} {wl} {side}: max QPS {view['max_qps']} "
            f"(first fail {view['lowest_failing_qps']})",
            flush=True,
        )
        return view

    def workload(self, srv: Server, rec: dict[str, Any], wl: str) -> None:
        w: dict[str, Any] = {}
        rec["workloads"][wl] = w
        sides = sides_for(self.smoke, rec.get("best_static_split") if not self.smoke else None)
        if self.args.side:
            sides = custom_sides(self.args.side)
        elif self.args.sides:
            sides = {k: v for k, v in sides.items() if k in self.args.sides.split(",")}
        for side, settings in sides.items():
            if self.budget.left_s() < self.side_s() * 0.8:
                w[side] = {"skipped": "device time"}
                continue
            try:
                w[side] = self.max_qps(srv, rec, wl, side, settings, ladder=bool(self.args.ladder))
            except Exception as exc:  # noqa: BLE001 - the other sides still run
                w[side] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
            self.save()
        add_comparisons(w)

    def score_chat(self, srv: Server, rec: dict[str, Any]) -> None:
        """Scoring max QPS (P99 TTFT SLO) while chat streams at a fixed QPS in the background;
        the chat's latencies over the whole search and per scoring probe (`chat_by_probe`)."""
        a = self.args
        res: dict[str, Any] = {
            "chat_workload": "sharegpt",
            "chat_qps": a.chat_qps,
            "score_workload": a.score_workload,
            "score_slo": a.score_slo,
        }
        rec["score_chat"] = res
        sides = sides_for(self.smoke, None)
        names: list[str] = ["off", "auto"]
        if self.args.side:  # the baselines and auto of --side, as in the workload parts
            sides = custom_sides(self.args.side)
            names = list(sides)
        for side in names:
            if self.args.sides and side not in self.args.sides.split(","):
                continue
            if self.budget.left_s() < self.search_s():
                res[side] = {"skipped": "device time"}
                continue
            apply_settings(srv.url, sides[side])
            chat_path = self.out_dir / f"{rec['slug']}-chatbg-{side}.json"
            # The background chat outlasts the search (stopped by SIGTERM after it): every
            # probe runs under chat load. bench.serve then writes what completed: the chat's
            # own latencies under this side's scoring load (the other half of the trade), per
            # request, to be split by probe (the sides' searches probe different loads).
            chat_s = self.search_s() * 2 + 10
            chat_count = (
                ["--num-requests", str(a.num_requests * 20)]
                if self.smoke
                else ["--duration", str(chat_s)]
            )
            bg = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.serve",
                    "--url",
                    srv.url,
                    "--workload",
                    "sharegpt",
                    "--scale",
                    str(a.scale),
                    *chat_count,
                    "--qps",
                    str(a.chat_qps),
                    "--seed",
                    "7",
                    "--no-reset-prefix-cache",
                    "--no-progress",
                    "--record-requests",
                    "--out",
                    str(chat_path),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                time.sleep(1.0 if self.smoke else 3.0)  # chat is streaming before the probes
                view = self.max_qps(
                    srv,
                    rec,
                    "score-chat",
                    side,
                    sides[side],
                    workload=a.score_workload,
                    slo=a.score_slo,
                    qps0=a.score_start_qps,
                )
                view["chat_still_running_at_end"] = bg.poll() is None
                res[side] = view
            finally:
                if bg.poll() is None:
                    bg.terminate()  # SIGTERM: bench.serve stops and writes what completed
                    try:
                        bg.wait(20)
                    except subprocess.TimeoutExpired:
                        bg.kill()
            if isinstance(res.get(side), dict):
                res[side]["chat_background"] = background_chat_view(chat_path)
                res[side]["chat_background_by_probe"] = background_chat_by_probe(
                    chat_path, self.out_dir / res[side]["file"]
                )
            self.save()
        add_chat_at_common_qps(res)
        add_score_chat_by_probe(res)
        if isinstance(res.get("off"), dict) and isinstance(res.get("auto"), dict):
            res["score_qps_ratio_auto_vs_off"] = ratio(
                res["off"].get("max_qps"), res["auto"].get("max_qps")
            )
            tbt = [
                ((res[s].get("chat_background") or {}).get("tbt_ms") or {}).get("p99")
                for s in ("off", "auto")
            ]
            res["chat_p99_tbt_ratio_auto_vs_off"] = ratio(tbt[0], tbt[1])

    def ablation(self, srv: Server, rec: dict[str, Any]) -> None:
        a = self.args
        # One QPS for all three comparisons: below off's max on `mixed` when measured.
        off_max = ((rec["workloads"].get("mixed") or {}).get("off") or {}).get("max_qps")
        qps = round(0.8 * off_max, 3) if off_max else a.start_qps
        res: dict[str, Any] = {"workload": "mixed", "qps": qps, "rounds": a.ablation_rounds}
        rec["ablation"] = res
        for name, (sa, sb) in ablation_pairs(self.smoke).items():
            est = 2 * a.ablation_rounds * self.run_s()
            if self.budget.left_s() < est:
                res[name] = {"skipped": "device time"}
                continue
            path = self.out_dir / f"{rec['slug']}-ablation-{name}.json"
            try:
                e = run_harness(
                    "bench.compare",
                    [
                        "--url",
                        srv.url,
                        "--a",
                        sa,
                        "--b",
                        sb,
                        "--workload",
                        "mixed",
                        "--scale",
                        str(a.scale),
                        *self.count_args(),
                        "--qps",
                        str(qps),
                        "--rounds",
                        str(a.ablation_rounds),
                        "--seed",
                        "0",
                        "--slo",
                        a.slo,
                        "--out",
                        str(path),
                    ],
                    self.timeout(est),
                )
                r = e["record"]
                res[name] = {
                    "a": sa,
                    "b": sb,
                    "comparison": r.get("comparison"),
                    "server_settings": [
                        x.get("server_settings") for s in ("a", "b") for x in r[s]["runs"]
                    ],
                    "file": path.name,
                    "wall_s": e["wall_s"],
                }
            except Exception as exc:  # noqa: BLE001
                res[name] = {"a": sa, "b": sb, "error": f"{type(exc).__name__}: {exc}"[:1500]}
            self.save()

    def model(self, model: str, parts: list[str], port: int) -> None:
        slug = model.split(":")[-1].replace("/", "_")
        rec: dict[str, Any] = {"slug": slug, "workloads": {}}
        self.results["models"][model] = rec
        extra = ["--prefill-policy", "fcfs", *self.args.server_args.split()]
        srv = Server(model, port, extra, self.out_dir / f"server-{slug}.log")
        rec["server_cmd"] = " ".join(["python3", *srv.cmd[1:]])
        started = self.part(
            f"{model}/start",
            self.args.start_s,
            lambda: (
                rec.__setitem__(
                    "startup_s", srv.start(min(self.args.start_s * 2, self.budget.left_s() - 5))
                )
                or True
            ),
        )
        if not started:
            rec["server_log_tail"] = srv.log_tail()
            return
        try:
            rec["state_at_start"] = http_json(srv.url + "/admin/api/state").get("partition")
            if self.args.static_split is not None:
                rec["best_static_split"] = self.args.static_split
            plan = dict(self.plan([model], parts))
            for p in parts:
                est = plan.get(f"{model}/{p}", 0.0)
                if p == "screen":
                    if self.smoke or self.args.static_split is not None:
                        continue
                    self.part(f"{model}/screen", est, self.screen, srv, rec)
                elif p in WORKLOADS:
                    self.part(f"{model}/{p}", est * 0.6, self.workload, srv, rec, p)
                elif p == "score-chat":
                    self.part(f"{model}/score-chat", est * 0.6, self.score_chat, srv, rec)
                elif p == "ablation":
                    self.part(f"{model}/ablation", est / 3, self.ablation, srv, rec)
            try:
                st = http_json(srv.url + "/admin/api/state")
                rec["cost_model"] = st.get("cost_model")
                rec["cost_model_mape"] = (st.get("cost_model") or {}).get("mape")
                rec["state_at_end"] = st.get("partition")
            except Exception as exc:  # noqa: BLE001
                rec["state_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            srv.stop()
            rec["server_log_tail"] = srv.log_tail(1500)
            self.save()

    def run(self) -> int:
        models = [m for m in self.args.models.split(",") if m]
        parts = [p for p in self.args.parts.split(",") if p]
        unknown = set(parts) - set(DEFAULT_PARTS)
        if unknown:
            raise SystemExit(f"unknown parts {sorted(unknown)}; known: {DEFAULT_PARTS}")
        plan = self.plan(models, parts)
        self.results["plan"] = [{"part": p, "est_s": round(s)} for p, s in plan]
        total = sum(s for _, s in plan)
        print(f"plan ({total:.0f} s estimated, deadline {self.args.deadline_s:.0f} s):")
        for p, s in plan:
            print(f"  {p:40s} ~{s:5.0f} s")
        self.save()
        for i, m in enumerate(models):
            self.model(m, parts, self.args.port + i)
        self.save()
        print(table(self.results))
        print(f"wrote {self.path}")
        return 0 if not self.results["errors"] else 1


def device_name(smoke: bool) -> str:
    if smoke:
        return "cpu (smoke)"
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        return "unknown"


def table(results: dict[str, Any]) -> str:
    def f(v: Any, d: int = 2) -> str:
        return "-" if not isinstance(v, (int, float)) else f"{v:.{d}f}"

    lines = [
        "",
        "=== serving: max QPS at P99 SLO; P99 TTFT / TBT (ms) at max QPS ===",
        "| model | workload | side | max QPS | P99 TTFT | P99 TBT |",
        "|---|---|---|---|---|---|",
    ]
    for model, m in results["models"].items():
        for wl, w in (m.get("workloads") or {}).items():
            for side in ("off", "auto", "static"):
                v = w.get(side)
                if not isinstance(v, dict):
                    continue
                at = v.get("at_max_qps") or {}
                lines.append(
                    f"| {model} | {wl} | {side} | {f(v.get('max_qps'))} | "
                    f"{f((at.get('ttft_ms') or {}).get('p99'), 0)} | "
                    f"{f((at.get('tbt_ms') or {}).get('p99'), 1)} |"
                    + (f" {v.get('error') or v.get('skipped')}"[:80] if "max_qps" not in v else "")
                    + (f" DRIFT: {v['mode_drift']}"[:90] if v.get("mode_drift") else "")
                )
        sc = m.get("score_chat") or {}
        if sc:
            lines.append(
                f"{model} score+chat: score max QPS off "
                f"{f((sc.get('off') or {}).get('max_qps'))} auto "
                f"{f((sc.get('auto') or {}).get('max_qps'))}"
            )
        for name, v in (m.get("ablation") or {}).items():
            if isinstance(v, dict) and v.get("comparison"):
                row = {r["metric"]: r["ratio_b_over_a"] for r in v["comparison"]}
                lines.append(
                    f"{model} ablation {name}: B/A "
                    + ", ".join(f"{k}={f(x)}" for k, x in list(row.items())[:6])
                )
    s = results["summary"]
    lines.append(
        "summary: "
        + ", ".join(
            f"{k}={f(s.get(k), 3)}"
            for k in (
                "throughput_ratio_auto_vs_off",
                "p99_tbt_ratio_auto_vs_off",
                "p99_ttft_ratio_auto_vs_off",
                "cost_model_mape",
            )
        )
    )
    for k in results["skipped"]:
        lines.append(f"SKIPPED {k}")
    for k, e in results["errors"].items():
        lines.append(f"ERROR {k}: {e[:200]}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="random:qwen2.5-3b")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS))
    p.add_argument("--rev", default="unknown", help="git revision of the tree (pass it in)")
    p.add_argument("--command", help="the command line to record (default: this one)")
    p.add_argument("--tag", default="partition")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "bench/results")
    p.add_argument("--deadline-s", type=float, default=480.0)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument(
        "--server-args",
        default="--partition auto --calibrate false",
        help="extra `app serve` options (one string)",
    )
    p.add_argument("--start-s", type=float, default=60.0, help="estimated server start-up")
    p.add_argument("--static-split", type=int, help="skip the screen: this prefill SM count")
    p.add_argument(
        "--sides", help="run only these sides of each workload (comma list of off,auto,static)"
    )
    p.add_argument(
        "--side",
        action="append",
        default=[],
        help="NAME:SETTINGS (repeat): the sides of each workload instead of off/auto/static, "
        "e.g. off-2k:partition=off,budget=2048 (bench.compare's settings: policy, partition, "
        "budget, tbt); sides named off* are baselines, auto is compared with the best",
    )
    p.add_argument(
        "--screen-fracs",
        default="0.5,0.75",
        help="candidate static splits as fractions of the SMs (nearest pre-created)",
    )
    p.add_argument("--screen-qps", type=float, default=4.0)
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--duration-s", type=float, default=8.0, help="arrivals per run (seconds)")
    p.add_argument("--drain-s", type=float, default=4.0, help="estimated drain per run")
    p.add_argument("--num-requests", type=int, default=6, help="requests per run (--smoke)")
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=60.0,
        help="per-request limit in every harness run (a timed-out request counts as failed)",
    )
    p.add_argument("--start-qps", type=float, default=2.0)
    p.add_argument("--max-probes", type=int, default=3)
    p.add_argument(
        "--ladder",
        help="comma list of QPS: every side runs every rate (no search); max QPS is judged "
        "afterwards against --slo and each of --slos",
    )
    p.add_argument(
        "--slos", help="';'-separated extra SLO sets to judge a ladder against (reporting)"
    )
    p.add_argument("--slo", default="ttft:2000,tpot:60")
    p.add_argument("--score-slo", default="ttft:1000")
    p.add_argument(
        "--score-workload",
        default="post-recommendation",
        choices=(
            "post-recommendation",
            "post-recommendation-stream",
            "credit-verification",
            "short-scoring",
        ),
        help="the scoring load of score-chat (bench/workloads.py); a stream of users "
        "(post-recommendation-stream) runs primed: its first users cached before each probe",
    )
    p.add_argument("--score-start-qps", type=float, default=4.0)
    p.add_argument("--chat-qps", type=float, default=2.0)
    p.add_argument("--ablation-rounds", type=int, default=1)
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="RESULTS_JSON",
        help="merge results files of several calls into <out-dir>/<tag>-<date>.json; no runs",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU plumbing check: policies instead of partitions, few requests",
    )
    return p


def custom_sides(specs: list[str]) -> dict[str, str]:
    """`--side NAME:SETTINGS` (repeated) -> {name: settings}, in the order given. Baselines are
    the sides whose name starts with "off" (e.g. `off-2k:partition=off,budget=2048`,
    `off-tbt:partition=off,budget=8192,tbt=80`)."""
    sides: dict[str, str] = {}
    for spec in specs:
        name, sep, settings = spec.partition(":")
        if not sep or not name or not settings or name in sides:
            raise SystemExit(f"--side wants NAME:SETTINGS with a new name, got {spec!r}")
        sides[name] = settings
    return sides


# Issue 13's first target: auto no worse than the best baseline by more than this fraction on
# P99 TBT, TTFT P50 and total tokens/s, at every load level.
TARGET_TOLERANCE = 0.05


def _p99_tbt(side: dict[str, Any], q: str) -> float | None:
    """A probe's P99 gap between tokens: its own, or (scoring beside chat, whose requests have
    no gaps) that of the chat streaming in the background during the probe."""
    own = ((side.get("probes", {}).get(q) or {}).get("tbt_ms") or {}).get("p99")
    if own is not None:
        return own
    chat = (side.get("chat_background_by_probe") or {}).get(q) or {}
    return (chat.get("tbt_ms") or {}).get("p99")


def probe_check(base: dict[str, Any], auto: dict[str, Any]) -> dict[str, Any]:
    """auto against one baseline at every QPS both probed: auto / baseline for P99 TBT (for
    scoring beside chat: the chat's), TTFT P50 (scoring: its latency) and total tokens/s, and
    whether all three are within TARGET_TOLERANCE (latencies at most 1 + tol, tokens/s at
    least 1 - tol). Probes without a figure (records from before P50s were kept) leave that
    ratio None and do not count against it."""
    by_probe: dict[str, Any] = {}
    for q, a in sorted(auto.get("probes", {}).items(), key=lambda kv: float(kv[0])):
        b = base.get("probes", {}).get(q)
        if not a or not b:
            continue
        r = {
            "p99_tbt_ratio": ratio(_p99_tbt(base, q), _p99_tbt(auto, q)),
            "p50_ttft_ratio": ratio(
                (b.get("ttft_ms") or {}).get("p50"), (a.get("ttft_ms") or {}).get("p50")
            ),
            "total_tokens_ratio": ratio(
                b.get("total_token_throughput"), a.get("total_token_throughput")
            ),
        }
        tol = TARGET_TOLERANCE
        r["within_target"] = all(
            r[k] is None or r[k] <= 1 + tol for k in ("p99_tbt_ratio", "p50_ttft_ratio")
        ) and (r["total_tokens_ratio"] is None or r["total_tokens_ratio"] >= 1 - tol)
        by_probe[q] = r
    return {
        "by_probe": by_probe,
        "within_target_at_every_probe": bool(by_probe)
        and all(r["within_target"] for r in by_probe.values()),
    }


# `auto_by_probe`'s key for the check against the best baseline figure by figure.
BEST_PER_FIGURE = "best-per-figure"


def best_per_figure(baselines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A side made of the baselines' best figure at each probe any of them ran: the lowest P99
    TBT (beside scoring: the background chat's), the lowest TTFT P50, the most total tokens/s
    — issue 13's "best baseline" read strictly, each figure from whichever baseline had it."""

    def best(values: list[float | None], pick: Any) -> float | None:
        present = [v for v in values if v is not None]
        return pick(present) if present else None

    probes: dict[str, Any] = {}
    for q in sorted({q for b in baselines.values() for q in b.get("probes", {})}, key=float):
        ran = [b for b in baselines.values() if b.get("probes", {}).get(q)]
        if not ran:
            continue
        probes[q] = {
            "tbt_ms": {"p99": best([_p99_tbt(b, q) for b in ran], min)},
            "ttft_ms": {
                "p50": best([(b["probes"][q].get("ttft_ms") or {}).get("p50") for b in ran], min)
            },
            "total_token_throughput": best(
                [b["probes"][q].get("total_token_throughput") for b in ran], max
            ),
        }
    return {"probes": probes}


def by_probe_checks(baselines: dict[str, dict[str, Any]], auto: dict[str, Any]) -> dict[str, Any]:
    """`auto_by_probe`: auto against each baseline, and with several, against the best figure
    of any of them at each probe (`BEST_PER_FIGURE`)."""
    out = {k: probe_check(v, auto) for k, v in baselines.items()}
    if len(baselines) > 1:
        out[BEST_PER_FIGURE] = probe_check(best_per_figure(baselines), auto)
    return out


def add_comparisons(w: dict[str, Any]) -> None:
    """(Re)compute auto/static vs off for one workload's sides, and, when several baselines
    ran (sides named off*), auto vs the best of them (the highest max QPS)."""
    off = w.get("off")
    for side in ("auto", "static"):
        other = w.get(side)
        if off and other and "max_qps" in off and "max_qps" in other:
            w[f"{side}_vs_off"] = compare_modes(off, other)
    baselines = {
        k: v
        for k, v in w.items()
        if k.startswith("off") and isinstance(v, dict) and v.get("max_qps") is not None
    }
    auto = w.get("auto")
    if len(baselines) > 1 and auto and auto.get("max_qps") is not None:
        best = max(baselines, key=lambda k: baselines[k]["max_qps"])
        w["best_baseline"] = best
        w["auto_vs_best_baseline"] = compare_modes(baselines[best], auto)
        w["auto_by_probe"] = by_probe_checks(baselines, auto)


def merge_records(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One model's record from two calls: workloads merged per workload and side (b wins per
    side; comparisons recomputed), other keys from b where b has them."""
    out = {**a, **{k: v for k, v in b.items() if v not in (None, {}, [])}}
    wls: dict[str, Any] = {}
    for name in {*(a.get("workloads") or {}), *(b.get("workloads") or {})}:
        w = {**((a.get("workloads") or {}).get(name) or {})}
        w.update(((b.get("workloads") or {}).get(name)) or {})
        add_comparisons(w)
        wls[name] = w
    out["workloads"] = wls
    sc = {**(a.get("score_chat") or {}), **(b.get("score_chat") or {})}
    # Copies: add_chat_at_common_qps rewrites keys of the sides (the inputs stay as they were).
    sc = {k: {**v} if isinstance(v, dict) else v for k, v in sc.items()}
    if sc:
        if isinstance(sc.get("off"), dict) and isinstance(sc.get("auto"), dict):
            sc["score_qps_ratio_auto_vs_off"] = ratio(
                sc["off"].get("max_qps"), sc["auto"].get("max_qps")
            )
        add_chat_at_common_qps(sc)
        add_score_chat_by_probe(sc)
        out["score_chat"] = sc
    return out


def merge_files(paths: list[str], out_path: Path) -> dict[str, Any]:
    """Merge the results of several device calls (each under its own deadline) into one file,
    keeping every call's command, revision and date, and recompute the summary."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged: dict[str, Any] = {
        "command": [r.get("command") for r in runs],
        "git_revision": sorted({str(r.get("git_revision")) for r in runs}),
        "device": sorted({str(r.get("device")) for r in runs}),
        "date": max(str(r.get("date")) for r in runs),
        "merged_from": [Path(p).name for p in paths],
        "definitions": runs[-1].get("definitions"),
        "models": {},
        "skipped": [],
        "errors": {},
    }
    for r in runs:
        for model, rec in (r.get("models") or {}).items():
            prev = merged["models"].get(model)
            merged["models"][model] = merge_records(prev, rec) if prev else rec
        merged["skipped"] += r.get("skipped") or []
        merged["errors"].update(r.get("errors") or {})
    merged["summary"] = build_summary(merged["models"])
    out_path.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    return merged


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        path = Path(args.out_dir) / f"{args.tag}-{dt.date.today().isoformat()}.json"
        print(table(merge_files(args.merge, path)))
        print(f"wrote {path}")
        return 0
    return Orchestrator(args).run()


if __name__ == "__main__":
    sys.exit(main())
