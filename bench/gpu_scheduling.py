"""Issue 17's GPU measurement of the prefill policies over HTTP, in one device call under a
hard deadline.

    python3 -m bench.gpu_scheduling --model random:llama-3.1-8b --rev REV --deadline-s 480 \\
        --out-dir $OUT                                   # bench/gpu_next.sh plan o
    python3 -m bench.gpu_scheduling --report $OUT/gpu-scheduling-DATE.json --plot fig.png
    python3 -m bench.gpu_scheduling --report call1.json call2.json   # merged

What it does, in order, each step timed against an estimate (a step that would overrun the
deadline is skipped and recorded as skipped; every step's error is recorded; the JSON is
rewritten after each step, so a call killed at its limit keeps what it did):

1. `profile`: `python -m bench.prefill_profile` on the device (the simulator's service-time
   profile, and a JCT calibration fitted on its calibration half that every server then loads
   with `--jct-calibration`: the policies rank with a measured model, as with `--calibrate`).
2. `--parts`, in the given order: `workload:pool:policies:repeats`, e.g.
   `post-recommendation:0.5:fcfs,srjf:2` (`...:2-2`: repeat 2 alone, so two calls can each run
   one repeat of a narrow search; a search without repeat 1 in its run starts at
   `--start-qps`, and `--report` merges the calls' files). `pool` is the KV pool as a fraction of the
   workload's working set (the sum of its users' profile tokens, from `bench.workloads` at
   the part's `--scale`), given to the server as `--num-kv-blocks`, or `default` (the
   engine's own sizing). Consecutive parts with the same workload and pool share one server
   (`app serve --partition off`), which is switched between policies (`PUT
   /admin/api/policy`). For each repeat (repeat r uses workload seed r - 1; the policies run
   in the given order on odd repeats, reversed on even ones) and policy: reset the prefix
   cache, prime it (one request per user, one at a time, so a run starts from a service's
   warm state, not from an empty cache), then `bench.serve --find-max-qps` with the P99 `--slo-ms`
   (probes carry the cache over). FCFS starts at `--start-qps` in repeat 1; every other search
   starts at FCFS's max QPS of repeat 1, so a policy's first probe is the P99 comparison at
   FCFS's max QPS that issue 17's target asks for, and with `--search-factor 1.5` its second is the
   "1.5x FCFS" one. Per probe: P99 / mean latency, completed, the server's prefix-cache hit
   rate over that probe.
3. The summary: per (workload, pool) and policy, max QPS per repeat and its mean and spread,
   its ratio to FCFS's (same repeat), the P99 ratio at FCFS's max QPS, and hit rates. Repeats
   after the first start every policy, FCFS included, at FCFS's max QPS of repeat 1, so the
   P99 ratio there exists in every repeat whatever the policy order.

`--smoke` (CPU, random:tiny): tiny prompts, a fixed request count per probe; proves the
plumbing (server, admin switches, priming, search, ratios), not performance.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.gpu_serving import Budget, Server, apply_settings, http_json, run_harness
from bench.serve import CLIENT_CPU_WARN_PERCENT

DEFAULT_PARTS = (
    "post-recommendation:0.5:fcfs,srjf:2;"
    "post-recommendation:1:fcfs,srjf:1;"
    "post-recommendation:default:fcfs,srjf:1;"
    "post-recommendation:0.5:spf,srjf-oneshot:1;"
    "credit-verification:0.5:fcfs,srjf:1"
)
# credit-verification at full scale (40k-60k-token histories, 60 users: ~3M tokens) needs
# ~390 GB of KV at 1x its working set for an 8B model; at 0.25 (10k-15k, ~750k tokens, ~98 GB)
# both 0.5x and 1x fit an H200.
DEFAULT_SCALES = "post-recommendation=1,credit-verification=0.25"
DEFAULT_START_QPS = (
    "post-recommendation@0.5=4.5,post-recommendation@1=30,post-recommendation@default=40,"
    "post-recommendation=4,credit-verification=4"
)
# P99 SLO per workload (ms of end-to-end latency): 10x the median cold prefill of a mean-length
# prompt on the H200 (interim profile: 14,150 tokens 0.36 s; 12,516 at scale 0.25 of credit
# 0.31 s), as the simulator's default SLO, so that SRJF's default fairness offset (0.1: a cold
# request waits at most ~10x its own prefill) suits it (docs/scheduling.md, "Fairness").
DEFAULT_SLO_MS = "post-recommendation=3600,credit-verification=3100"
BLOCK_SIZE = 16  # the engine's default KV block size (the servers use it)


# ------------------------------------------------------------------------- configuration


def parse_parts(text: str) -> list[dict[str, Any]]:
    """`workload:pool:policies:repeats;...` -> parts (ValueError on a malformed one)."""
    parts = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        fields = item.split(":")
        if len(fields) != 4:
            raise ValueError(f"part {item!r} is not workload:pool:policies:repeats")
        workload, pool, policies, repeats = fields
        if pool != "default":
            frac = float(pool)
            if not frac > 0:
                raise ValueError(f"part {item!r}: pool must be > 0 or 'default'")
            pool = f"{frac:g}"
        names = [p for p in policies.split(",") if p]
        # `repeats` is N (repeats 1..N) or A-B (repeats A..B: one device call runs seed 0, the
        # next seed 1, when a call fits one repeat of a narrow search).
        first, _, last = repeats.partition("-")
        first_repeat, last_repeat = (int(first), int(last)) if last else (1, int(first))
        if not names or first_repeat < 1 or last_repeat < first_repeat:
            raise ValueError(f"part {item!r} needs policies and repeats N >= 1 or A-B, 1 <= A <= B")
        parts.append(
            {
                "workload": workload,
                "pool": pool,
                "policies": names,
                "first_repeat": first_repeat,
                "repeats": last_repeat,
            }
        )
    if not parts:
        raise ValueError("no parts")
    return parts


def parse_map(text: str, cast: Any = float) -> dict[str, Any]:
    """`a=1,b=2` -> {"a": 1.0, "b": 2.0}."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not key=value")
        out[key.strip()] = cast(value)
    return out


def pool_blocks(working_set_tokens: int, fraction: float, block_size: int = BLOCK_SIZE) -> int:
    return max(1, math.ceil(fraction * working_set_tokens / block_size))


def spread(values: list[float | None]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


# ------------------------------------------------------------------------- result views


def search_view(record: dict[str, Any]) -> dict[str, Any]:
    """A bench.serve --find-max-qps record reduced to what the comparison needs."""
    search = record.get("max_qps_search") or {}
    probes = {}
    for run in record.get("runs") or []:
        m = run.get("metrics") or {}
        lat = m.get("e2el_ms") or {}
        probes[str(float(run["qps"]))] = {
            "p99_ms": lat.get("p99"),
            "mean_ms": lat.get("mean"),
            "completed": m.get("completed"),
            "failed": m.get("failed"),
            "request_throughput": m.get("request_throughput"),
            # The client's own load: past ~80 % of a core it sends late, and the probe then
            # measures the client (`client_bound_probes`).
            "client_cpu_percent": m.get("client_cpu_percent"),
            "send_lag_p99_ms": (m.get("send_lag_ms") or {}).get("p99"),
            "hit_rate": (run.get("prefix_cache") or {}).get("hit_rate"),
            "hit_tokens": (run.get("prefix_cache") or {}).get("hit_tokens"),
            "query_tokens": (run.get("prefix_cache") or {}).get("query_tokens"),
            "prime": run.get("prime"),
        }
    hit = sum(p["hit_tokens"] or 0 for p in probes.values())
    query = sum(p["query_tokens"] or 0 for p in probes.values())
    return {
        "max_qps": search.get("max_qps"),
        "lowest_failing_qps": search.get("lowest_failing_qps"),
        "max_qps_is_lower_bound": search.get("lowest_failing_qps") is None,
        "probes": probes,
        "hit_rate_over_search": hit / query if query else None,
    }


def client_bound_probes(results: dict[str, Any]) -> list[str]:
    """Probes whose client ran past `CLIENT_CPU_WARN_PERCENT` of a core: it sent and read
    late, so such a probe measured the load generator, not the server (the default pool on
    an H100, 2026-12-05: send lag P99 3 s at 87-97 %, the server's own P99 under 1 s)."""
    out = []
    for wl, pools in results.items():
        for pool, by_policy in pools.items():
            for policy, reps in by_policy.items():
                for r in reps:
                    for qps, p in (r.get("probes") or {}).items():
                        cpu = p.get("client_cpu_percent")
                        if cpu is not None and cpu > CLIENT_CPU_WARN_PERCENT:
                            lag = p.get("send_lag_p99_ms")
                            lag_text = f", send lag P99 {lag:.0f} ms" if lag is not None else ""
                            out.append(
                                f"{wl}@{pool} {policy} r{r.get('repeat')} at {float(qps):g} "
                                f"QPS: the client at {cpu:.0f} % of a core{lag_text}"
                            )
    return out


def gathered_searches(results: dict[str, Any]) -> list[str]:
    """Searches whose step trace has steps that discarded prompt KV beside prefill context:
    the FlashInfer backend copied every member's context in every layer there (the pool had
    no room for a suffix; docs/scheduling.md, "What is left of the gathered path")."""
    out = []
    for wl, pools in results.items():
        for pool, by_policy in pools.items():
            for policy, reps in by_policy.items():
                for r in reps:
                    load = (r.get("steps") or {}).get("device_load") or {}
                    n, ms = load.get("gathered_steps"), load.get("gathered_device_ms")
                    if n and ms is not None and load.get("device_ms"):
                        out.append(
                            f"{wl}@{pool} {policy} r{r.get('repeat')}: {n} of "
                            f"{load.get('num_steps')} traced steps, {ms / load['device_ms']:.1%} "
                            "of their device time"
                        )
    return out


# Probes whose P99 lies within these fractions of the SLO make up the slope at the SLO.
SLOPE_BAND = (2 / 3, 4 / 3)


def p99_rise_per_qps(probes: dict[str, dict[str, Any]], slo_ms: float) -> float | None:
    """How sharply a search's P99 crosses the SLO: the least-squares slope (ms of P99 a QPS)
    over its probes whose P99 lies within SLOPE_BAND of the SLO (None: fewer than two). A
    flat one makes the max QPS at that SLO ill-conditioned: a P99 off by x ms moves it by
    x / slope QPS. SRJF's is flat at the 0.5x pool (its tail is the cold prompts the fairness
    window holds, not the load: docs/scheduling.md, "The default sizing measured")."""
    lo, hi = SLOPE_BAND[0] * slo_ms, SLOPE_BAND[1] * slo_ms
    pts = [
        (float(q), p["p99_ms"])
        for q, p in probes.items()
        if p.get("p99_ms") is not None and lo <= p["p99_ms"] <= hi
    ]
    if len(pts) < 2:
        return None
    mean_q = statistics.fmean(q for q, _ in pts)
    mean_p = statistics.fmean(p for _, p in pts)
    var_q = sum((q - mean_q) ** 2 for q, _ in pts)
    if var_q == 0:
        return None
    return sum((q - mean_q) * (p - mean_p) for q, p in pts) / var_q


def summarize(results: dict[str, Any], slo_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """Per (workload, pool): each policy's max QPS per repeat (mean, spread), over FCFS's of
    the same repeat, P99 at FCFS's max QPS over FCFS's P99 there, and hit rates; with the
    SLO per workload (`slo_ms`), how sharply each search's P99 crosses it
    (`p99_rise_per_qps`)."""
    out: dict[str, Any] = {}
    for wl, pools in results.items():
        for pool, by_policy in pools.items():
            fcfs = by_policy.get("fcfs") or []
            entry: dict[str, Any] = {}
            for policy, reps in by_policy.items():
                done = [r for r in reps if isinstance(r, dict) and "max_qps" in r]
                ratios, p99_ratios, mean_ratios = [], [], []
                brackets: list[list[float | None]] = []
                for r in done:
                    base = next(
                        (f for f in fcfs if f.get("repeat") == r["repeat"] and "max_qps" in f),
                        None,
                    )
                    if base is None:
                        continue
                    if base["max_qps"] and r["max_qps"] is not None:
                        ratios.append(r["max_qps"] / base["max_qps"])
                        # A search ends on a bracket [max_qps, lowest failing); the ratio of two
                        # brackets lies in [mine / their fail, my fail / theirs]: with unequal
                        # bracket widths the lower bounds' ratio alone is biased.
                        their_fail = base.get("lowest_failing_qps")
                        my_fail = r.get("lowest_failing_qps")
                        brackets.append(
                            [
                                r["max_qps"] / their_fail if their_fail else None,
                                my_fail / base["max_qps"] if my_fail else None,
                            ]
                        )
                    # Both probed the policy's first QPS (FCFS's max QPS of repeat 1).
                    q = str(float(r["start_qps"]))
                    mine = r["probes"].get(q) or {}
                    theirs = base["probes"].get(q) or {}
                    if mine.get("p99_ms") and theirs.get("p99_ms"):
                        p99_ratios.append(mine["p99_ms"] / theirs["p99_ms"])
                    if mine.get("mean_ms") and theirs.get("mean_ms"):
                        mean_ratios.append(mine["mean_ms"] / theirs["mean_ms"])
                slo = (slo_ms or {}).get(wl)
                slopes = [p99_rise_per_qps(r["probes"], slo) if slo else None for r in done]
                entry[policy] = {
                    # ms of P99 a QPS near the SLO, and the max QPS a 5 % P99 error moves
                    "p99_ms_per_qps_near_slo": spread(slopes),
                    "max_qps_per_5pct_p99": spread(
                        [0.05 * slo / k if slo and k and k > 0 else None for k in slopes]
                    ),
                    "max_qps": spread([r["max_qps"] for r in done]),
                    "max_qps_per_repeat": [r["max_qps"] for r in done],
                    "any_lower_bound": any(r["max_qps_is_lower_bound"] for r in done),
                    "max_qps_over_fcfs": spread(ratios),
                    # per repeat [lowest, highest] ratio both searches' brackets allow (None:
                    # a side never passed / never failed)
                    "max_qps_over_fcfs_bracket": brackets,
                    "p99_at_fcfs_max_qps_over_fcfs": spread(p99_ratios),
                    "mean_at_fcfs_max_qps_over_fcfs": spread(mean_ratios),
                    "hit_rate": spread([r["hit_rate_over_search"] for r in done]),
                    "skipped_or_failed": [r for r in reps if "max_qps" not in r],
                }
            out[f"{wl}@{pool}"] = entry
    return out


# ------------------------------------------------------------------------- orchestration


class Orchestrator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.budget = Budget(args.deadline_s)
        self.out_dir = Path(args.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.work = self.out_dir / f"{args.tag}-work"
        self.work.mkdir(exist_ok=True)
        self.parts = parse_parts(args.parts)
        self.scales = parse_map(args.scales)
        self.start_qps = parse_map(args.start_qps)
        self.slo_ms = parse_map(args.slo_ms)
        missing = {p["workload"] for p in self.parts} - set(self.slo_ms)
        if missing:
            raise ValueError(f"no --slo-ms for {sorted(missing)}")
        from bench.prefill_profile import git_revision

        date = dt.datetime.now(dt.UTC)
        self.path = self.out_dir / f"{args.tag}-{date.date().isoformat()}.json"
        self.results: dict[str, Any] = {
            "tool": "greenlane bench.gpu_scheduling",
            "command": args.command or " ".join(["python3 -m bench.gpu_scheduling", *sys.argv[1:]]),
            "git_revision": git_revision(args.rev),
            "device": device_name(args.smoke),
            "date": date.isoformat(timespec="seconds"),
            "smoke": args.smoke,
            "model": args.model,
            "settings": {
                "slo_p99_ms": self.slo_ms,
                "slo_metric": "e2el (end-to-end latency; = TTFT for scoring)",
                "duration_s": None if args.smoke else args.duration_s,
                "num_requests": args.num_requests if args.smoke else None,
                "request_timeout_s": {w: self.timeout_s(w) for w in self.slo_ms},
                "max_probes": args.max_probes,
                "search_factor": args.search_factor,
                "scales": self.scales,
                "start_qps": self.start_qps,
                "server_args": args.server_args,
                "client_procs": args.client_procs,
                "parts": self.parts,
            },
            "definitions": {
                "latency": "end-to-end latency of a /v1/score request (e2el = ttft for scoring)",
                "pool": "KV pool as a fraction of the working set (sum of the users' profile "
                "tokens at the part's scale), or 'default' (the engine's own sizing)",
                "probe": "one open-loop Poisson run of --duration-s seconds at one QPS; the "
                "prefix cache carries over between the probes of a search (reset + primed "
                "before the search)",
                "repeat": "repeat r uses workload seed r - 1 (other requests and arrivals)",
                "hit_rate": "prefix-cache hit tokens / prompt tokens over a probe (server "
                "counters, admitted requests)",
            },
            "plan": [],
            "profile": None,
            "servers": {},
            "workloads": {},
            "results": {},
            "summary": {},
            "skipped": [],
            "errors": {},
        }

    # -- bookkeeping
    def save(self) -> None:
        self.results["summary"] = summarize(self.results["results"], self.slo_ms)
        self.results["left_s_at_save"] = round(self.budget.left_s(), 1)
        self.path.write_text(json.dumps(self.results, indent=1, default=str) + "\n")

    def skip(self, name: str, need_s: float) -> None:
        msg = f"{name}: needs ~{need_s:.0f} s, {self.budget.left_s():.0f} s left"
        self.results["skipped"].append(msg)
        print(f"SKIP {msg}", flush=True)

    def error(self, name: str, exc: BaseException) -> None:
        traceback.print_exc()
        self.results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]

    def timeout_s(self, workload: str) -> float:
        """Per-request limit: a request past the SLO fails the probe anyway; 2 s beyond it
        keeps an overloaded probe's drain short."""
        return self.args.request_timeout_s or self.slo_ms[workload] / 1e3 + 2.0

    # -- estimates (seconds)
    def probe_s(self, workload: str) -> float:
        if self.args.smoke:
            return 6.0
        # arrivals + drain (a passing probe's tail is under the SLO; a failing one's is cut at
        # the request timeout) + reset/switch/counter calls
        return self.args.duration_s + 0.5 * self.slo_ms[workload] / 1e3 + 1.5

    def prime_s(self, workload: str) -> float:
        users = self.workloads[workload]["users"]
        if self.args.smoke:
            return 0.3 * len(users)
        svc = self.service()
        return sum(svc.median_s(t, 0) + 0.05 for t in users.values())

    def search_s(self, workload: str) -> float:
        return 4.0 + self.prime_s(workload) + self.args.max_probes * self.probe_s(workload)

    def service(self) -> Any:
        """Service-time model for the estimates: the profile measured in this call if any,
        else the interim one."""
        from bench.sim_profile import DEFAULT_PROFILE, PrefillProfile, ProfileService

        if getattr(self, "_service", None) is None:
            prof = self.results.get("profile") or {}
            path = prof.get("path") if prof.get("ok") else None
            self._service = ProfileService(PrefillProfile.load(path or DEFAULT_PROFILE))
        return self._service

    # -- workloads
    def load_workloads(self) -> None:
        """Users' profile lengths per workload (the working set) and the request sequence,
        recorded so that bench.sim_vs_gpu can check it replays the same requests."""
        from bench.workloads import WorkloadGenerator, load_tokenizer

        tok = load_tokenizer(self.args.tokenizer)
        self.workloads: dict[str, Any] = {}
        repeats = max(p["repeats"] for p in self.parts)
        for wl in dict.fromkeys(p["workload"] for p in self.parts):
            scale = self.scales.get(wl, 1.0)
            per_seed = {}
            for seed in range(repeats):
                gen = WorkloadGenerator(wl, tok, seed, scale, verify=False)
                users = gen.group_prefix_tokens()
                per_seed[str(seed)] = {
                    "users": users,
                    "working_set_tokens": sum(users.values()),
                    "first_requests": [
                        [r.group, r.num_prompt_tokens] for r in gen.take(self.args.record_requests)
                    ],
                }
            self.workloads[wl] = {"scale": scale, **per_seed["0"], "per_seed": per_seed}
            self.results["workloads"][wl] = self.workloads[wl]

    # -- steps
    def run_profile(self) -> None:
        a = self.args
        path = self.out_dir / f"prefill-profile-{a.tag}-{dt.date.today().isoformat()}.json"
        jct = self.work / "jct-calibration.json"
        rec: dict[str, Any] = {"ok": False, "path": str(path), "est_s": a.profile_s}
        self.results["profile"] = rec
        if self.budget.left_s() < a.profile_s:
            self.skip("profile", a.profile_s)
            rec["skipped"] = True
            return
        argv = [
            "--model",
            a.model,
            "--device",
            a.device,
            "--out",
            str(path),
            "--jct-out",
            str(jct),
            "--deadline-s",
            str(a.profile_s - 5),
            *(["--rev", a.rev] if a.rev else []),
            *a.profile_args.split(),
        ]
        try:
            e = run_harness(
                "bench.prefill_profile", argv, min(a.profile_s * 1.5, self.budget.left_s() - 5)
            )
            rec.update({"ok": True, "wall_s": e["wall_s"], "jct_calibration": str(jct)})
            rec["describe"] = json.loads(path.read_text()).get("provenance", {}).get("measurement")
        except Exception as exc:  # noqa: BLE001 - the servers fall back to no calibration
            self.error("profile", exc)
        self.save()

    def jct_args(self) -> list[str]:
        a = self.args
        if a.jct_calibration:
            return ["--jct-calibration", a.jct_calibration]
        prof = self.results.get("profile") or {}
        if prof.get("ok"):
            return ["--jct-calibration", prof["jct_calibration"]]
        return []

    def groups(self) -> list[tuple[str, str, list[dict[str, Any]]]]:
        """Consecutive parts with the same (workload, pool): one server each."""
        out: list[tuple[str, str, list[dict[str, Any]]]] = []
        for p in self.parts:
            if out and out[-1][0] == p["workload"] and out[-1][1] == p["pool"]:
                out[-1][2].append(p)
            else:
                out.append((p["workload"], p["pool"], [p]))
        return out

    def server_for(self, workload: str, pool: str, index: int) -> tuple[Server, dict[str, Any]]:
        a = self.args
        ws = self.workloads[workload]["working_set_tokens"]
        rec: dict[str, Any] = {"workload": workload, "pool": pool, "working_set_tokens": ws}
        extra = ["--partition", "off", "--prefill-policy", "fcfs", "--calibrate", "false"]
        extra += ["--device", a.device] if a.device != "auto" else []
        if pool != "default":
            blocks = pool_blocks(ws, float(pool))
            extra += ["--num-kv-blocks", str(blocks)]
            rec.update({"num_kv_blocks": blocks, "pool_tokens": blocks * BLOCK_SIZE})
        extra += self.jct_args() + a.server_args.split()
        key = f"{workload}@{pool}"
        srv = Server(a.model, a.port + index, extra, self.work / f"server-{index}.log")
        rec["server_cmd"] = " ".join(["python3", *srv.cmd[1:]])
        self.results["servers"][key] = rec
        return srv, rec

    def search(
        self, srv: Server, workload: str, pool: str, policy: str, repeat: int
    ) -> dict[str, Any]:
        a = self.args
        res = self.results["results"].setdefault(workload, {}).setdefault(pool, {})
        first = next((r for r in res.get("fcfs", []) if r.get("repeat") == 1), None)
        if first and first.get("max_qps") and (policy != "fcfs" or repeat > 1):
            start, why = first["max_qps"], "FCFS's max QPS in repeat 1"
        else:
            key = f"{workload}@{pool}" if f"{workload}@{pool}" in self.start_qps else workload
            start, why = self.start_qps.get(key, 2.0), f"--start-qps {key}"
        applied = apply_settings(srv.url, f"policy={policy}")
        http_json(srv.url + "/admin/api/prefix-cache/reset", "POST", {})
        wait_idle(srv.url)
        path = self.work / f"{workload}-{pool}-{policy}-r{repeat}.json"
        count = (
            ["--num-requests", str(a.num_requests)]
            if a.smoke
            else ["--duration", str(a.duration_s)]
        )
        argv = [
            "--url",
            srv.url,
            "--workload",
            workload,
            "--scale",
            str(self.scales.get(workload, 1.0)),
            *count,
            "--request-timeout",
            str(self.timeout_s(workload)),
            "--qps",
            f"{start:g}",
            "--find-max-qps",
            "--max-probes",
            str(a.max_probes),
            "--search-factor",
            str(a.search_factor),
            "--seed",
            str(repeat - 1),
            "--slo",
            f"e2el:{self.slo_ms[workload]:g}",
            "--no-reset-prefix-cache",
            "--prime-prefixes",
            "--client-procs",
            str(a.client_procs),
            "--out",
            str(path),
            *(["--tokenizer", a.tokenizer] if a.tokenizer else []),
            *(["--record-requests"] if a.per_request else []),
        ]
        est = self.search_s(workload)
        started = time.monotonic()
        e = run_harness("bench.serve", argv, min(2 * est, self.budget.left_s() - 3))
        view = search_view(e["record"])
        view["steps"] = search_steps(srv.url, started, path.with_name(f"{path.stem}.steps.json.gz"))
        view.update(
            {
                "repeat": repeat,
                "seed": repeat - 1,
                "start_qps": start,
                "start_qps_from": why,
                "server_policy": applied.get("policy"),
                "file": path.name,
                "wall_s": e["wall_s"],
                "est_s": round(est, 1),
            }
        )
        print(
            f"{workload}@{pool} {policy} r{repeat}: max QPS {view['max_qps']} (first fail "
            f"{view['lowest_failing_qps']}; hit {view['hit_rate_over_search']}) "
            f"in {e['wall_s']:.0f} s (est {est:.0f})",
            flush=True,
        )
        return view

    def run_group(self, index: int, workload: str, pool: str, parts: list[dict[str, Any]]) -> None:
        a = self.args
        est_one = self.search_s(workload)
        if self.budget.left_s() < a.start_s + est_one:
            self.skip(f"{workload}@{pool} (server and all its parts)", a.start_s + est_one)
            return
        srv, rec = self.server_for(workload, pool, index)
        res = self.results["results"].setdefault(workload, {}).setdefault(pool, {})
        try:
            rec["startup_s"] = srv.start(min(a.start_s * 3, self.budget.left_s() - 5))
            state = http_json(srv.url + "/admin/api/state")
            rec["kv_at_start"] = state.get("kv")
            rec["policy_at_start"] = (state.get("policy") or {}).get("current")
            self.save()
            for part in parts:
                for repeat in range(part["first_repeat"], part["repeats"] + 1):
                    order = part["policies"] if repeat % 2 else part["policies"][::-1]
                    for policy in order:
                        name = f"{workload}@{pool}/{policy}/r{repeat}"
                        slot = res.setdefault(policy, [])
                        if self.budget.left_s() < est_one:
                            self.skip(name, est_one)
                            slot.append({"repeat": repeat, "skipped": "device time"})
                            continue
                        try:
                            slot.append(self.search(srv, workload, pool, policy, repeat))
                        except Exception as exc:  # noqa: BLE001 - the next search still runs
                            self.error(name, exc)
                            slot.append({"repeat": repeat, "error": f"{type(exc).__name__}"})
                        self.save()
            try:
                rec["state_at_end"] = {
                    k: v
                    for k, v in http_json(srv.url + "/admin/api/state").items()
                    if k in ("engine", "kv", "prefix_cache", "policy")
                }
            except Exception as exc:  # noqa: BLE001
                rec["state_error"] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a server that does not start ends its group
            self.error(f"{workload}@{pool}/server", exc)
        finally:
            srv.stop()
            rec["server_log_tail"] = srv.log_tail(1500)
            self.save()

    def plan(self) -> list[tuple[str, float]]:
        plan: list[tuple[str, float]] = []
        if self.args.profile:
            plan.append(("profile", self.args.profile_s))
        for wl, pool, parts in self.groups():
            plan.append((f"{wl}@{pool}/server start", self.args.start_s))
            n = sum(len(p["policies"]) * (p["repeats"] - p["first_repeat"] + 1) for p in parts)
            plan.append((f"{wl}@{pool}/{n} searches", n * self.search_s(wl)))
        return plan

    def run(self) -> int:
        self.load_workloads()
        if self.args.dry_run:
            plan = self.plan()
            total = sum(t for _, t in plan)
            for step, t in plan:
                print(f"  {step:55s} ~{t:5.0f} s")
            print(f"total ~{total:.0f} s (deadline {self.args.deadline_s:.0f} s); nothing run")
            return 0
        self.save()
        if self.args.profile:
            self.run_profile()
            self._service = None  # estimates from the measured profile from now on
        plan = self.plan()
        self.results["plan"] = [{"step": s, "est_s": round(t)} for s, t in plan]
        total = sum(t for _, t in plan)
        print(f"plan ({total:.0f} s estimated, {self.budget.left_s():.0f} s left):", flush=True)
        for step, t in plan:
            print(f"  {step:55s} ~{t:5.0f} s", flush=True)
        for i, (wl, pool, parts) in enumerate(self.groups()):
            self.run_group(i, wl, pool, parts)
        self.save()
        print(markdown(self.results))
        print(f"wrote {self.path}")
        return 0 if not self.results["errors"] else 1


def search_steps(url: str, started_s: float, raw_path: Path | None = None) -> dict[str, Any]:
    """The server's step trace over the search (the steps that ended since `started_s`, this
    process's monotonic clock, read after the server answered, which ages its steps as it
    answers; at most its last 4,096 steps: its last probes, near the max QPS), summarised by
    `bench.host_profile.step_summary`: the prefill-only steps' device, launch and plan time and
    the device's idle before them, the host time per step that the simulator leaves out.
    Steps older than the search are left out: the trace is the server's, and a short search
    (a 0.5x pool runs a few hundred steps) would otherwise carry the steps of the search
    before it on the same server (every second search's summary until 2026-12-05).
    `whole_search`: whether the trace reaches back to the search's start. `raw_path`: the
    search's steps themselves, gzipped JSON, each with `end_unix_s` (when it ended, on the
    clock of the per-request records' `start_unix_s`), so that they can be read per probe
    (`bench.sim_vs_gpu --gpu-searches`). An error is recorded, not raised: the search's
    figures stand."""
    from bench.host_profile import TRACE_STEPS, step_summary, steps_since

    try:
        steps = http_json(url + f"/admin/api/steps?limit={TRACE_STEPS}")["steps"]
    except Exception as e:  # noqa: BLE001 - a diagnostic beside the result
        return {"error": repr(e)[:200]}
    answered_unix_s = time.time()
    mine = steps_since(steps, started_s, time.monotonic())
    out = step_summary(mine)
    out["steps_before_search"] = len(steps) - len(mine)
    out["whole_search"] = len(mine) < len(steps) or len(steps) < TRACE_STEPS
    if raw_path is not None:
        raw = [{**st, "end_unix_s": round(answered_unix_s - st["age_s"], 6)} for st in mine]
        body = json.dumps({"answered_unix_s": answered_unix_s, "steps": raw}).encode()
        try:
            raw_path.write_bytes(gzip.compress(body))
            out["raw_file"] = raw_path.name
        except OSError as e:
            out["raw_error"] = repr(e)[:200]
    return out


def wait_idle(url: str, timeout_s: float = 15.0) -> bool:
    """Wait until the server has no waiting or running request (aborted stragglers of the
    previous probe gone); False if it did not get there in time."""
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        q = (http_json(url + "/admin/api/state").get("queues")) or {}
        if not q.get("waiting") and not q.get("running"):
            return True
        time.sleep(0.2)
    return False


def device_name(smoke: bool) -> str:
    if smoke:
        return "cpu (smoke)"
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        return "unknown"


# ------------------------------------------------------------------------- report


def merge_results(files: list[dict[str, Any]]) -> dict[str, Any]:
    """One results dict from several runs' (the first's settings and servers): every run's
    searches under `results`, skips and errors concatenated. A repeat measured twice is kept
    twice (the summary pairs each search with FCFS's of the same repeat, the first found)."""
    if len(files) == 1:
        return files[0]
    merged = {**files[0], "results": {}, "skipped": [], "errors": {}}
    for i, f in enumerate(files):
        for wl, pools in (f.get("results") or {}).items():
            for pool, by_policy in pools.items():
                slot = merged["results"].setdefault(wl, {}).setdefault(pool, {})
                for policy, reps in by_policy.items():
                    slot.setdefault(policy, []).extend(reps)
        merged["skipped"] += f.get("skipped") or []
        merged["errors"].update(
            {f"{k} (file {i + 1})": v for k, v in (f.get("errors") or {}).items()}
        )
    return merged


def markdown(results: dict[str, Any]) -> str:
    """The docs table: per (workload, pool) and policy."""

    def f(s: dict[str, Any] | None, d: int = 2) -> str:
        if not s or s.get("mean") is None:
            return "-"
        if s["n"] == 1:
            return f"{s['mean']:.{d}f}"
        return f"{s['mean']:.{d}f} [{s['min']:.{d}f}, {s['max']:.{d}f}]"

    lines = [
        "| workload @ pool | policy | max QPS at P99 SLO | ÷ FCFS | ÷ FCFS within the brackets "
        "| P99 at FCFS's max QPS ÷ FCFS | mean there ÷ FCFS | hit rate "
        "| P99 rise near the SLO (ms a QPS) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def brackets(e: dict[str, Any]) -> str:
        parts = []
        for lo, hi in e.get("max_qps_over_fcfs_bracket") or []:
            parts.append(
                f"[{'-' if lo is None else f'{lo:.2f}'}, {'-' if hi is None else f'{hi:.2f}'})"
            )
        return " ".join(parts) or "-"

    for key, by_policy in results.get("summary", {}).items():
        pool = (results.get("servers", {}).get(key) or {}).get("num_kv_blocks")
        label = f"{key} ({pool} blocks)" if pool else key
        for policy, e in by_policy.items():
            lb = " (≥: never failed)" if e.get("any_lower_bound") else ""
            lines.append(
                f"| {label} | {policy} | {f(e['max_qps'])}{lb} | {f(e['max_qps_over_fcfs'])} "
                f"| {brackets(e)} | {f(e['p99_at_fcfs_max_qps_over_fcfs'])} "
                f"| {f(e['mean_at_fcfs_max_qps_over_fcfs'])} | {f(e['hit_rate'])} "
                f"| {f(e.get('p99_ms_per_qps_near_slo'), 0)} |"
            )
    s = results.get("settings", {})
    lines.append(
        f"\nP99 SLO (ms) {s.get('slo_p99_ms')}; probes of {s.get('duration_s')} s; mean "
        "[min, max] over repeats. P99 rise near the SLO: the slope over a search's probes "
        "whose P99 is within 2/3-4/3 of the SLO; a P99 off by 5 % moves the max QPS by "
        "0.05 x SLO / slope."
    )
    for k in client_bound_probes(results.get("results") or {}):
        lines.append(f"CLIENT-BOUND {k}: that probe measured the load generator")
    for k in gathered_searches(results.get("results") or {}):
        lines.append(f"GATHERED {k} copied their contexts (no room to keep a suffix)")
    for k in results.get("skipped") or []:
        lines.append(f"SKIPPED {k}")
    for k, e in (results.get("errors") or {}).items():
        lines.append(f"ERROR {k}: {e[:200]}")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> None:
    """Latency vs offered QPS per (workload, pool): P99 (solid) and mean (dashed) of every
    probe, one colour per policy, one marker per repeat; the SLO as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(wl, pool) for wl, pools in results["results"].items() for pool in pools]
    if not panels:
        raise ValueError("no results to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (wl, pool) in zip(axes[0], panels, strict=True):
        slo_ms = results["settings"]["slo_p99_ms"][wl]
        by_policy = results["results"][wl][pool]
        for i, (policy, reps) in enumerate(by_policy.items()):
            for rep in reps:
                pts = sorted(
                    (float(q), p["p99_ms"], p["mean_ms"])
                    for q, p in (rep.get("probes") or {}).items()
                    if p.get("p99_ms") is not None
                )
                if not pts:
                    continue
                marker = "os^Dv<>p"[(rep["repeat"] - 1) % 8]  # one per repeat
                label = f"{policy} r{rep['repeat']}"
                xs = [p[0] for p in pts]
                ax.plot(xs, [p[1] / 1e3 for p in pts], marker + "-", color=f"C{i}", label=label)
                ax.plot(xs, [p[2] / 1e3 for p in pts], marker + "--", color=f"C{i}", alpha=0.5)
        ax.axhline(slo_ms / 1e3, color="gray", linestyle=":")
        ax.set_yscale("log")
        ax.set_xlabel("offered load (QPS)")
        ax.set_ylabel("latency (s): P99 solid, mean dashed")
        ax.set_title(f"{wl} @ pool {pool}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{results.get('model')} on {results.get('device')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m bench.gpu_scheduling", description=__doc__)
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--device", default="auto", help="servers' and profile's --device")
    p.add_argument("--rev", help="git revision as the caller knows it (recorded beside git's)")
    p.add_argument("--command", help="the command line to record (default: this one)")
    p.add_argument("--tag", default="gpu-scheduling")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--deadline-s", type=float, default=480.0)
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--parts", default=DEFAULT_PARTS, help="workload:pool:policies:repeats;...")
    p.add_argument("--scales", default=DEFAULT_SCALES, help="workload=scale,...")
    p.add_argument(
        "--start-qps",
        default=DEFAULT_START_QPS,
        help="FCFS's first probe: workload=QPS or workload@pool=QPS (the latter wins)",
    )
    p.add_argument(
        "--slo-ms", default=DEFAULT_SLO_MS, help="P99 end-to-end latency SLO per workload (ms)"
    )
    p.add_argument(
        "--duration-s",
        type=float,
        default=14.0,
        help="arrivals per probe (s); a probe much shorter than the SLO passes loads it cannot "
        "sustain (its backlog drains within the SLO)",
    )
    p.add_argument("--num-requests", type=int, default=6, help="requests per probe (--smoke)")
    p.add_argument("--request-timeout-s", type=float, help="default: the SLO + 2 s")
    p.add_argument("--max-probes", type=int, default=4)
    p.add_argument("--search-factor", type=float, default=1.5)
    p.add_argument("--server-args", default="", help="extra `app serve` options")
    p.add_argument(
        "--client-procs",
        type=int,
        default=4,
        help="bench.serve --client-procs (since 2026-12-05; one process, as before, sent late "
        "past ~110 QPS of post recommendation: docs/scheduling.md)",
    )
    p.add_argument("--start-s", type=float, default=35.0, help="estimated server start-up")
    p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the prefill profile first (and serve with its JCT calibration)",
    )
    p.add_argument("--profile-s", type=float, default=100.0, help="the profile's time limit")
    p.add_argument("--profile-args", default="", help="extra bench.prefill_profile options")
    p.add_argument("--jct-calibration", help="serve with this calibration (not the profile's)")
    p.add_argument("--tokenizer", help="bench.serve --tokenizer (default: the default model's)")
    p.add_argument("--record-requests", type=int, default=400, help="request shapes recorded")
    p.add_argument(
        "--per-request",
        action="store_true",
        help="each probe's requests' send times and latencies in the search's bench.serve "
        "record (bench.serve --record-requests): the GPU's queue request by request, beside the "
        "simulator's replay of the same requests",
    )
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check (random:tiny)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan's time estimates; run nothing"
    )
    p.add_argument(
        "--report",
        metavar="RESULTS_JSON",
        nargs="+",
        help="no runs: print the table (and --plot); several files (e.g. one repeat each, "
        "parts `...:1-1` and `...:2-2`) are merged first",
    )
    p.add_argument("--plot", help="with --report: latency-vs-QPS PNG")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        results = merge_results([json.loads(Path(f).read_text()) for f in args.report])
        if results.get("results"):  # recomputed: a file written before a summary field existed
            slo = (results.get("settings") or {}).get("slo_p99_ms")
            results["summary"] = summarize(results["results"], slo)
        print(markdown(results))
        if args.plot:
            plot(results, args.plot)
            print(f"wrote {args.plot}")
        return 0
    try:
        orch = Orchestrator(args)
    except ValueError as exc:
        print(f"bench.gpu_scheduling: {exc}", file=sys.stderr)
        return 2
    return orch.run()


if __name__ == "__main__":
    sys.exit(main())
