"""How far the simulator's predictions are from the GPU's, per cache size.

    python -m bench.sim_vs_gpu --gpu bench/results/gpu-scheduling-DATE.json \
        --profile bench/results/prefill-profile-gpu-scheduling-DATE.json \
        --out bench/results/sim-vs-gpu-DATE.json
    python -m bench.sim_vs_gpu --issue-point --out bench/results/sim-vs-gpu-issue-point.json

`--gpu`: for every (workload, pool) that bench.gpu_scheduling measured, the simulator replays
the GPU protocol: the same requests (bench.workloads with the run's seeds and scale; the
recorded request shapes are checked), the same Poisson arrival times per probe
(bench.serve.arrival_times_s), the same pool (the server's KV blocks x 16 tokens), a cache
reset and primed before each search and carried across its probes, one scheduler JCT model per
server refined online across all its searches (as the engine's), the same P99 SLO, request
timeout and search (bench.serve.search_max_qps itself, same start, factor and probe budget).
Service times come from `--profile` (default: the one the GPU run measured, if the file is
beside the results, else bench.sim_profile.DEFAULT_PROFILE), the scheduler's JCT from its
calibration half, as the servers loaded it. Reported per (workload, pool) and policy: max QPS
and its ratio to FCFS on each side, per repeat and mean, and the simulator's relative error on
the ratio (issue 17's target: within 20 %); beside it, on each side, the P99 and mean latency
at the policy's first probe over FCFS's there (the GPU run's "at FCFS's max QPS", as
bench.gpu_scheduling.summarize pairs them) and the prefix-cache hit rate (mean over a search's
probes, mean over repeats). The simulator's own protocol (primed, >= 1,000 requests spanning
>= 10 SLOs, fine bisection: the sustained ratio) is reported beside it. The output records the
command, git revision, date and machine.

`--issue-point`: issue 17's one GPU data point (post recommendation, KV pool about half the
working set, one server switched between FCFS and SRJF, one round each at 4 and 8 QPS: SRJF's
mean latency 0.48x / 0.20x FCFS's, P99 0.96x / 0.33x, completed requests per second 1.62x at
8 QPS). Its request count, scale and calibration were not recorded: the replay assumes
`bench.compare`'s protocol (cache reset before each side, no priming) and sweeps the unknowns
(`--scale`, `--num-requests`, `--seeds`), and both JCT models a server could have had.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.host_profile import NO_WORK_GAP_MS, read_json
from bench.metrics import meets_p99_slo
from bench.serve import arrival_times_s, search_max_qps
from bench.sim import (
    BlockPrefixCache,
    SimSetup,
    add_plan_ahead_args,
    add_setup_args,
    build_setup,
    plan_ahead_from_args,
    plan_ahead_record,
    prime_cache,
    run_experiment,
    simulate,
)
from bench.sim_profile import DEFAULT_PROFILE
from bench.sim_workloads import from_bench_requests
from bench.workloads import WorkloadGenerator, load_tokenizer
from policies import JCTModel, make_policy

ISSUE_POINT = {
    4.0: {"mean": 0.48, "p99": 0.96},
    8.0: {"mean": 0.20, "p99": 0.33, "completed_per_s": 1.62},
}


class ScaledForwards:
    """A what-if service: the wrapped one's forwards times `one` (one request) or `batch`
    (several), e.g. as a GPU's steps read them against the profile's price, step by step
    (`step_price_check`; not the batch model check's band table, whose mean request misprices
    mixed bands). Not a measurement: recorded as `forward_scales_what_if` beside the replay."""

    def __init__(self, inner: Any, one: float, batch: float) -> None:
        self.inner, self.one, self.batch = inner, one, batch

    def _scale(self, items: Any) -> float:
        return self.one if len(items) == 1 else self.batch

    def forward_s(self, items: Any, rng: Any) -> float:
        return self.inner.forward_s(items, rng) * self._scale(items)

    def median_forward_s(self, items: Any) -> float:
        return self.inner.median_forward_s(items) * self._scale(items)

    def __getattr__(self, name: str) -> Any:  # everything else: the wrapped service's
        return getattr(self.inner, name)


@dataclass(frozen=True)
class ReplayOptions:
    """A --gpu replay's plan-ahead and follow-GPU-probes settings, built once from the CLI."""

    # The engine's overlapped scheduling (bench.sim.simulate's `plan_ahead`): step N+1 chosen
    # when step N starts, or `plan_lead_s` before it ends; none ahead of a forward predicted
    # `overlap_max_step_s` long (a what-if: the engine's former --overlap-max-step-ms, removed
    # in the forty-fifth session; kept for replays of earlier GPU runs). Off by default, as
    # every replay before it ran.
    plan_ahead: bool = False
    plan_lead_s: float | None = None
    overlap_max_step_s: float | None = None
    # Follow: run the GPU search's own probes, in its order, instead of searching: every probe
    # is then comparable (a search of its own leaves the GPU's path after a different pass or
    # fail). `gpu_searches`: the folder of the searches' bench.serve files, whose per-request
    # records (`--per-request`) are paired with the replay's when following, and whose step
    # traces are priced step by step (`step_price_check`) either way.
    follow_gpu: bool = False
    gpu_searches: Path | None = None

    @classmethod
    def from_args(cls, p: argparse.ArgumentParser, args: argparse.Namespace) -> ReplayOptions:
        """The options `main`'s flags give; refuses those that need --gpu or each other."""
        if args.plan_ahead and not args.gpu:
            p.error("--plan-ahead replays a --gpu file")
        plan_lead_s, overlap_max_step_s = plan_ahead_from_args(p, args)
        if args.follow_gpu_probes and not args.gpu:
            p.error("--follow-gpu-probes replays a --gpu file")
        if args.gpu_searches and not args.gpu:
            p.error("--gpu-searches reads the searches of a --gpu file")
        return cls(
            plan_ahead=args.plan_ahead,
            plan_lead_s=plan_lead_s,
            overlap_max_step_s=overlap_max_step_s,
            follow_gpu=args.follow_gpu_probes,
            gpu_searches=Path(args.gpu_searches) if args.gpu_searches else None,
        )

    def record(self) -> dict[str, Any]:
        """What the output JSON names of these options (nothing for those left off)."""
        out: dict[str, Any] = {}
        if self.follow_gpu:
            out["follow_gpu_probes"] = True
        if self.plan_ahead:
            out["plan_ahead"] = True
            out.update(plan_ahead_record(True, self.plan_lead_s, self.overlap_max_step_s))
        return out


class Replayer:
    """The simulated side of one bench.gpu_scheduling results file."""

    def __init__(
        self,
        gpu: dict[str, Any],
        setup: SimSetup,
        tokenizer: Any,
        planned: bool = False,
        srjf_options: dict[str, float] | None = None,
        step_overhead_s: float = 0.0,
        options: ReplayOptions | None = None,
    ) -> None:
        self.gpu = gpu
        # Plan-ahead and follow mode (ReplayOptions): none by default.
        self.options = options or ReplayOptions()
        # Host time added to every simulated forward (a what-if unless read off the GPU run's
        # step trace: `bench.gpu_scheduling` records it per search since the 35th session).
        self.step_overhead_s = step_overhead_s
        self.planned = planned  # replay every planned search, not only those the GPU did
        # What-if settings of SRJF the GPU did not run (fairness_lambda, latency_slo_s); empty:
        # the policies as the servers ran them (their defaults).
        self.srjf_options = dict(srjf_options or {})
        self.setup = setup
        self.tok = tokenizer
        self.settings = gpu["settings"]
        self._gens: dict[tuple[str, int], WorkloadGenerator] = {}

    def gen(self, workload: str, seed: int) -> WorkloadGenerator:
        key = (workload, seed)
        if key not in self._gens:
            scale = self.gpu["workloads"][workload]["scale"]
            g = WorkloadGenerator(workload, self.tok, seed, scale, verify=False)
            recorded = self.gpu["workloads"][workload]["per_seed"][str(seed)]["first_requests"]
            mine = [[r.group, r.num_prompt_tokens] for r in g.take(len(recorded))]
            if mine != recorded:
                raise ValueError(
                    f"{workload} seed {seed}: the generator here does not make the requests the "
                    "GPU run sent (bench/workloads.py changed?)"
                )
            self._gens[key] = g
        return self._gens[key]

    def pool_tokens(self, key: str) -> int:
        srv = self.gpu["servers"][key]
        blocks = srv.get("num_kv_blocks") or (srv.get("kv_at_start") or {}).get("blocks_total")
        if not blocks:
            raise ValueError(f"{key}: the GPU file does not say how large the pool was")
        return int(blocks) * 16

    def search(
        self,
        workload: str,
        policy: str,
        seed: int,
        start_qps: float,
        cache: BlockPrefixCache,
        jct: JCTModel,
        gpu_search: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One search replayed (`gpu_search`: the GPU's record of it, which follow mode
        walks)."""
        from bench.metrics import SLO

        s = self.settings
        slo_ms = float(s["slo_p99_ms"][workload])
        timeout_s = float(s["request_timeout_s"][workload])
        gen = self.gen(workload, seed)
        cache.reset()
        priming = from_bench_requests(workload, gen.group_requests()).requests
        prime_cache(cache, priming, self.setup.service, jct)
        probes: dict[str, Any] = {}

        async def run_at(qps: float) -> dict[str, Any]:
            if s.get("duration_s"):
                arrivals = arrival_times_s(qps, seed, 1.0, None, float(s["duration_s"]))
            else:
                arrivals = arrival_times_s(qps, seed, 1.0, int(s["num_requests"]), None)
            wl = from_bench_requests(workload, gen.take(len(arrivals)))
            lat: list[float] = []
            records: list[dict[str, Any]] = []
            st = simulate(
                wl,
                make_policy(policy, jct_model=jct, **self.srjf_options),
                qps,
                service=self.setup.service,
                cache=cache,
                seed=zlib.crc32(f"{workload}:{policy}:{seed}:{qps}".encode()),
                jct_model=jct,
                arrivals_s=arrivals,
                latencies_out=lat,
                step_overhead_s=self.step_overhead_s,
                plan_ahead=self.options.plan_ahead,
                plan_lead_s=self.options.plan_lead_s,
                overlap_max_step_s=self.options.overlap_max_step_s,
                records_out=records,
            )
            ok = [x for x in lat if x <= timeout_s]
            p99 = float(np.percentile(np.asarray(ok), 99)) * 1e3 if ok else None
            mean = float(np.mean(ok)) * 1e3 if ok else None
            probes[str(float(qps))] = {
                "p99_ms": p99,
                "mean_ms": mean,
                "completed": len(ok),
                "failed": len(lat) - len(ok),
                "hit_rate": st.cache_hit_token_fraction,
                # The simulated GPU's work: near saturation its busy time per request is the
                # simulator's capacity (set it beside the GPU probe's request_throughput).
                "forwards": st.num_forwards,
                "mean_batch": round(len(lat) / st.num_forwards, 2) if st.num_forwards else None,
                "max_batch": st.max_batch,
                "busy_ms_per_request": round(st.busy_s / len(lat) * 1e3, 3) if lat else None,
            }
            if self.options.follow_gpu and gpu_search is not None:
                gpu_requests = self._gpu_requests(gpu_search, qps)
                probes[str(float(qps))].update(
                    beside_gpu_probe(
                        gpu_search, qps, records, gpu_requests, timeout_s, self.setup.service
                    )
                )
                gpu_steps = self.gpu_steps(gpu_search)
                if gpu_requests and gpu_steps:
                    probes[str(float(qps))]["gpu_steps"] = steps_in_probe(
                        gpu_steps, gpu_requests, timeout_s, self.setup.service
                    )
            return {
                "completed": len(ok),
                "failed": len(lat) - len(ok),
                "e2el_ms": {"p99": p99},
            }

        if self.options.follow_gpu and gpu_search is not None:
            slo = SLO(e2el_ms=slo_ms)
            passed = [
                q
                for q in (float(k) for k in gpu_search.get("probes") or {})
                if meets_p99_slo(asyncio.run(run_at(q)), slo)
            ]
            # The GPU's probes judged by the replay: not a search of its own.
            return {
                "max_qps": max(passed, default=None),
                "start_qps": start_qps,
                "probes": probes,
                "followed_gpu_probes": True,
            }
        out = asyncio.run(
            search_max_qps(
                run_at,
                SLO(e2el_ms=slo_ms),
                start_qps,
                int(s["max_probes"]),
                factor=float(s["search_factor"]),
            )
        )
        return {"max_qps": out["max_qps"], "start_qps": start_qps, "probes": probes}

    def _search_file(self, name: str | None) -> Any:
        """The parsed JSON of `name` in `gpu_searches` (or `NAME.gz`, or with a plan prefix
        such as `q-NAME`), else None."""
        folder = self.options.gpu_searches
        if folder is None or not name:
            return None
        found = sorted(
            p
            for p in folder.iterdir()
            if p.name.removesuffix(".gz") == name or p.name.removesuffix(".gz").endswith(f"-{name}")
        )
        if not found:
            return None
        return read_json(found[0])

    def _gpu_requests(self, gpu_search: dict[str, Any], qps: float) -> list[dict[str, Any]] | None:
        """The GPU probe's per-request records (bench.serve --record-requests), if the
        search's bench.serve file is in `gpu_searches` and recorded them. The file may be
        gzipped (`NAME.gz`: the records are ~10x smaller so, as committed)."""
        data = self._search_file(gpu_search.get("file"))
        runs = (data or {}).get("runs") or []
        run = next((r for r in runs if abs(float(r.get("qps", -1)) - qps) < 1e-9), None)
        return None if run is None else run.get("requests")

    def gpu_steps(self, gpu_search: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The search's own server steps (bench.gpu_scheduling saves them as
        `STEM.steps.json.gz` since the forty-first session), if they are in `gpu_searches`."""
        name = ((gpu_search.get("steps") or {}).get("raw_file") or "").removesuffix(".gz")
        data = self._search_file(name or None)
        return None if data is None else data.get("steps")

    def replay(self) -> dict[str, Any]:
        """Every (workload, pool) the GPU measured, its searches in the GPU's order."""
        out: dict[str, Any] = {}
        parts = self.settings["parts"]
        groups: list[tuple[str, str, list[dict[str, Any]]]] = []
        for p in parts:
            if groups and groups[-1][0] == p["workload"] and groups[-1][1] == p["pool"]:
                groups[-1][2].append(p)
            else:
                groups.append((p["workload"], p["pool"], [p]))
        for wl, pool, gparts in groups:
            key = f"{wl}@{pool}"
            gpu_res = (self.gpu["results"].get(wl) or {}).get(pool) or {}
            if key not in self.gpu["servers"] or not (gpu_res or self.planned):
                continue
            cache = BlockPrefixCache(self.pool_tokens(key))
            jct = self.setup.new_jct()  # one server: one model, refined across its searches
            sim_res: dict[str, list[dict[str, Any]]] = {}
            for part in gparts:
                # `repeats` is the part's last; A-B parts start at A (older files: at 1).
                for repeat in range(part.get("first_repeat", 1), part["repeats"] + 1):
                    order = part["policies"] if repeat % 2 else part["policies"][::-1]
                    for policy in order:
                        done = [
                            r
                            for r in gpu_res.get(policy, [])
                            if r.get("repeat") == repeat and "max_qps" in r
                        ]
                        if not done and not self.planned:
                            continue  # the GPU did not get to it
                        first = next((r for r in sim_res.get("fcfs", []) if r["repeat"] == 1), None)
                        if first and first["max_qps"] and (policy != "fcfs" or repeat > 1):
                            start = first["max_qps"]
                        else:
                            starts = self.settings["start_qps"]
                            start = float(starts.get(key, starts.get(wl, 2.0)))
                        if self.options.follow_gpu and done:
                            start = float(done[0]["start_qps"])  # the GPU's path
                        r = self.search(
                            wl, policy, repeat - 1, start, cache, jct, done[0] if done else None
                        )
                        r["repeat"] = repeat
                        sim_res.setdefault(policy, []).append(r)
                        print(
                            f"sim {key} {policy} r{repeat}: max QPS {r['max_qps']} "
                            f"(GPU {done[0]['max_qps'] if done else '-'})",
                            file=sys.stderr,
                            flush=True,
                        )
            out[key] = {"gpu": gpu_res, "sim": sim_res, "pool_tokens": self.pool_tokens(key)}
        return out


def beside_gpu_probe(
    gpu_search: dict[str, Any],
    qps: float,
    records: list[dict[str, Any]],
    gpu_requests: list[dict[str, Any]] | None,
    timeout_s: float,
    service: Any = None,
) -> dict[str, Any]:
    """The GPU's figures for the probe the replay just ran at `qps` (follow mode), and, with
    the GPU's per-request records, the two paired by request id: where the GPU's latency went
    (front end + HTTP, engine queue, prefill) against the replay's (queue, forward). With
    `service`, the paired requests' work on each side: every request's new and cached tokens
    priced as one forward of its own (`service.median_forward_s`), so that a difference in
    what was cached shows as work."""
    gpu = (gpu_search.get("probes") or {}).get(str(float(qps))) or {}
    out: dict[str, Any] = {
        "gpu_p99_ms": gpu.get("p99_ms"),
        "gpu_mean_ms": gpu.get("mean_ms"),
        "gpu_hit_rate": gpu.get("hit_rate"),
    }
    if not gpu_requests:
        return out
    sim = {r["request_id"]: r for r in records if r["latency_s"] <= timeout_s}
    pairs = [
        (g, sim[g["request_id"]])
        for g in gpu_requests
        if g.get("ok") and g.get("request_id") in sim
    ]

    def mean(values: list[float]) -> float | None:
        return round(float(np.mean(values)) * 1e3, 3) if values else None

    with_account = [(g, m) for g, m in pairs if g.get("engine_queue_s") is not None]
    out["paired"] = {
        "num_requests": len(pairs),
        "gpu_mean_ms": mean([g["ttft_s"] for g, _ in pairs]),
        "sim_mean_ms": mean([m["latency_s"] for _, m in pairs]),
        # The server's own account (a Greenlane score): its front end and HTTP, the engine's
        # queue and what followed it, against the replay's queue and forward.
        "gpu_front_end_ms": mean([g["ttft_s"] - g["server_s"] for g, _ in with_account]),
        "gpu_engine_queue_ms": mean([g["engine_queue_s"] for g, _ in with_account]),
        "sim_queue_ms": mean([m["queue_s"] for _, m in with_account]),
        "gpu_after_queue_ms": mean(
            [g["engine_ttft_s"] - g["engine_queue_s"] for g, _ in with_account]
        ),
        "sim_forward_ms": mean([m["latency_s"] - m["queue_s"] for _, m in with_account]),
        "cached_tokens_gpu_minus_sim_mean": round(
            float(np.mean([g["cached_tokens"] - m["cached_tokens"] for g, m in with_account])), 1
        )
        if with_account
        else None,
    }
    priced = [(g, m) for g, m in with_account if m.get("prompt_tokens")]
    if service is not None and priced:

        def work_s(prompt: int, cached: int) -> float:
            return service.median_forward_s([(max(prompt - cached, 1), cached)])

        gpu_s = sum(work_s(m["prompt_tokens"], g["cached_tokens"]) for g, m in priced)
        sim_s = sum(work_s(m["prompt_tokens"], m["cached_tokens"]) for _, m in priced)
        out["paired"]["gpu_work_s"] = round(gpu_s, 3)
        out["paired"]["sim_work_s"] = round(sim_s, 3)
    return out


def step_price_ms(st: dict[str, Any], service: Any) -> tuple[float, int]:
    """(the simulator's price of a traced prefill step as one forward, ms; its requests'
    cached context tokens each): its n requests as n equal parts of its new and context tokens,
    the trace keeping only their sums."""
    n = int(st["num_prefill_seqs"])
    u = max(round(st["num_prefill_tokens"] / n), 1)
    c = round((st.get("prefill_context_tokens") or 0) / n)
    return service.median_forward_s([(u, c)] * n) * 1e3, c


def steps_in_probe(
    steps: list[dict[str, Any]],
    requests: list[dict[str, Any]],
    timeout_s: float,
    service: Any,
) -> dict[str, Any]:
    """What the GPU's own steps did over one probe: those that ended between its first request
    and its last answer (a failed request's at the client's timeout), from the search's step
    trace (`end_unix_s`, the records' clock). Their device time against the simulator's price
    of the same forwards (`service.median_forward_s`; a step of n requests priced as n equal
    parts of its new and context tokens, the trace keeping only their sums) and the device's
    idle between them, long gaps (`NO_WORK_GAP_MS` or more, which bench.host_profile's
    `busy_share` leaves out as "nothing queued") included: whether the GPU ran slower than the
    simulator charges, or waited."""
    first_s = min(r["start_unix_s"] for r in requests)
    last_s = max(r["start_unix_s"] + (r.get("ttft_s") or timeout_s) for r in requests)
    mine = [
        st
        for st in steps
        if first_s <= st["end_unix_s"] <= last_s and st.get("device_ms") is not None
    ]
    prefill = [st for st in mine if st.get("num_prefill_seqs") and not st.get("num_decodes")]
    device_ms = sum(st["device_ms"] for st in prefill)
    price_ms = sum(step_price_ms(st, service)[0] for st in prefill)
    idle = [st["idle_before_ms"] for st in mine if st.get("idle_before_ms") is not None]
    window_ms = (last_s - first_s) * 1e3
    return {
        "window_ms": round(window_ms, 1),
        "num_steps": len(mine),
        "num_prefill_steps": len(prefill),
        "device_ms": round(device_ms, 1),
        "price_ms": round(price_ms, 1),
        "device_over_price": round(device_ms / price_ms, 4) if price_ms else None,
        "idle_ms": round(sum(idle), 1),
        "idle_ms_in_long_gaps": round(sum(g for g in idle if g >= NO_WORK_GAP_MS), 1),
        "device_share_of_window": round(sum(st["device_ms"] for st in mine) / window_ms, 4)
        if window_ms > 0
        else None,
    }


def planned_file(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """What bench.gpu_scheduling would record before measuring anything, for `--predict`: its
    settings, workload shapes and pool sizes (`default` pools: `--default-pool-blocks`)."""
    from bench.gpu_scheduling import parse_map, parse_parts, pool_blocks

    parts = parse_parts(args.parts)
    scales, slo_ms = parse_map(args.scales_map), parse_map(args.slo_ms)
    repeats = max(p["repeats"] for p in parts)
    workloads: dict[str, Any] = {}
    for wl in dict.fromkeys(p["workload"] for p in parts):
        per_seed = {}
        for seed in range(repeats):
            g = WorkloadGenerator(wl, tokenizer, seed, scales.get(wl, 1.0), verify=False)
            users = g.group_prefix_tokens()
            per_seed[str(seed)] = {
                "users": users,
                "working_set_tokens": sum(users.values()),
                "first_requests": [[r.group, r.num_prompt_tokens] for r in g.take(20)],
            }
        workloads[wl] = {"scale": scales.get(wl, 1.0), **per_seed["0"], "per_seed": per_seed}
    servers = {}
    for p in parts:
        ws = workloads[p["workload"]]["working_set_tokens"]
        blocks = (
            args.default_pool_blocks
            if p["pool"] == "default"
            else pool_blocks(ws, float(p["pool"]))
        )
        servers[f"{p['workload']}@{p['pool']}"] = {"num_kv_blocks": blocks}
    return {
        "settings": {
            "parts": parts,
            "slo_p99_ms": slo_ms,
            "request_timeout_s": {w: v / 1e3 + 2.0 for w, v in slo_ms.items()},
            "duration_s": args.duration_s,
            "num_requests": None,
            "max_probes": args.max_probes,
            "search_factor": args.search_factor,
            "start_qps": parse_map(args.start_qps),
        },
        "workloads": workloads,
        "servers": servers,
        "results": {},
    }


def predict(args: argparse.Namespace, setup: SimSetup, tokenizer: Any) -> dict[str, Any]:
    """The simulator's prediction of a bench.gpu_scheduling run (before it runs)."""
    plan = planned_file(args, tokenizer)
    replayed = Replayer(plan, setup, tokenizer, planned=True).replay()
    rows = []
    for key, v in replayed.items():
        sim = v["sim"]
        fcfs = {r["repeat"]: r for r in sim.get("fcfs", [])}
        for policy, reps in sim.items():
            for r in reps:
                base = fcfs.get(r["repeat"])
                q = str(float(r["start_qps"]))
                mine = r["probes"].get(q) or {}
                theirs = (base or {}).get("probes", {}).get(q) or {}
                rows.append(
                    {
                        "server": key,
                        "policy": policy,
                        "repeat": r["repeat"],
                        "max_qps": r["max_qps"],
                        "ratio_to_fcfs": r["max_qps"] / base["max_qps"]
                        if base and base["max_qps"] and r["max_qps"]
                        else None,
                        "p99_at_start_over_fcfs": mine["p99_ms"] / theirs["p99_ms"]
                        if mine.get("p99_ms") and theirs.get("p99_ms")
                        else None,
                        "all_probes_passed": all(
                            (p["p99_ms"] or 1e18)
                            <= plan["settings"]["slo_p99_ms"][key.split("@")[0]]
                            and not p["failed"]
                            for p in r["probes"].values()
                        ),
                    }
                )
    return {"plan": plan["settings"], "rows": rows, "replayed": replayed}


def ratios(by_policy: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per policy: max QPS per repeat and its ratio to FCFS's of the same repeat."""
    fcfs = {r["repeat"]: r["max_qps"] for r in by_policy.get("fcfs", []) if "max_qps" in r}
    out = {}
    for policy, reps in by_policy.items():
        per = [
            (r["repeat"], r["max_qps"], r["max_qps"] / fcfs[r["repeat"]])
            for r in reps
            if "max_qps" in r and r["max_qps"] and fcfs.get(r["repeat"])
        ]
        out[policy] = {
            "max_qps": [q for _, q, _ in per],
            "ratio_to_fcfs": [x for _, _, x in per],
            "ratio_mean": statistics.fmean([x for _, _, x in per]) if per else None,
        }
    return out


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def at_first_probe(by_policy: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per policy: P99 and mean latency at its first probe over FCFS's at the same QPS and
    repeat (both sides probe FCFS's repeat-1 max QPS there: bench.gpu_scheduling.summarize's
    "at FCFS's max QPS"), and the hit rate (mean of the probes', mean over repeats). Mean over
    repeats; None where a side lacks the numbers."""
    fcfs = {r["repeat"]: r for r in by_policy.get("fcfs", []) if "probes" in r}
    out: dict[str, dict[str, Any]] = {}
    for policy, reps in by_policy.items():
        p99s: list[float | None] = []
        means: list[float | None] = []
        hits: list[float | None] = []
        for r in reps:
            if "probes" not in r:
                continue  # skipped on the GPU
            hits.append(_mean([p.get("hit_rate") for p in r["probes"].values()]))
            base = fcfs.get(r["repeat"])
            q = str(float(r["start_qps"]))
            mine = r["probes"].get(q) or {}
            theirs = (base or {}).get("probes", {}).get(q) or {}
            for k, acc in (("p99_ms", p99s), ("mean_ms", means)):
                acc.append(mine[k] / theirs[k] if mine.get(k) and theirs.get(k) else None)
        out[policy] = {"p99": _mean(p99s), "mean": _mean(means), "hit_rate": _mean(hits)}
    return out


def batch_model_check(gpu: dict[str, Any], service: Any) -> list[dict[str, Any]]:
    """The simulator's price of a prefill-only forward against the GPU's, per batch size, on
    the batches the GPU ran: each search's step trace (`steps.device_load.prefill_by_batch`,
    bench.host_profile.device_load) gives, per band of batch sizes, the device time per
    request, the mean batch and the mean new and cached tokens per request; the simulator
    prices a forward of that many such requests (`median_forward_s`, batch correction
    included). `measured_over_sim` > 1: the simulator undercharges the GPU's batches (its
    capacity too high). Searches without a step trace are left out. Where the profile
    recorded device spans (`PrefillProfile.device_priced`), the same forward priced by them
    too (`sim_device_ms_per_seq`): device against device, the host's share left out.
    Hazard: a band's price is its *mean* request's, biased where a band mixes cold and warm
    requests (one-request steps at the 0.5x pool read 0.90-0.94 here, 1.03 priced step by
    step in the forty-fifth session): `step_price_check` is the measure of the forwards'
    price."""
    from bench.sim_profile import ProfileService

    profile = getattr(service, "profile", None)
    device_profile = profile.device_priced() if profile is not None else None
    device_service = ProfileService(device_profile) if device_profile is not None else None
    rows = []
    for wl, pools in (gpu.get("results") or {}).items():
        for pool, by_policy in pools.items():
            for policy, reps in by_policy.items():
                for r in reps:
                    load = ((r.get("steps") or {}).get("device_load")) or {}
                    for band in load.get("prefill_by_batch") or []:
                        batch = max(round(band["num_requests"] / band["num_steps"]), 1)
                        u = max(round(band["new_tokens_per_seq"]), 1)
                        c = round(band["context_tokens_per_seq"])
                        sim_ms = service.median_forward_s([(u, c)] * batch) * 1e3 / batch
                        dev_ms = (
                            device_service.median_forward_s([(u, c)] * batch) * 1e3 / batch
                            if device_service is not None
                            else None
                        )
                        rows.append(
                            {
                                "workload": wl,
                                "pool": pool,
                                "policy": policy,
                                "repeat": r.get("repeat"),
                                "num_seqs": band["num_seqs"],
                                "num_steps": band["num_steps"],
                                "mean_batch": batch,
                                "new_tokens_per_seq": u,
                                "context_tokens_per_seq": c,
                                "gpu_device_ms_per_seq": band["device_ms_per_seq"],
                                "sim_ms_per_seq": sim_ms,
                                "measured_over_sim": band["device_ms_per_seq"] / sim_ms,
                                "sim_device_ms_per_seq": dev_ms,
                                "measured_over_sim_device": (
                                    band["device_ms_per_seq"] / dev_ms if dev_ms else None
                                ),
                                "busy_share": load.get("busy_share"),
                            }
                        )
    return rows


# Kinds of prefill-only step for `step_price_check`.
STEP_KINDS = ("one cold", "one warm", "batched")


def step_kind(num_seqs: int, context_tokens: int) -> str:
    """One request with no cached context, one with some, or several."""
    if num_seqs > 1:
        return "batched"
    return "one warm" if context_tokens else "one cold"


def step_price_check(
    gpu: dict[str, Any],
    service: Any,
    steps_of: Callable[[dict[str, Any]], list[dict[str, Any]] | None],
) -> list[dict[str, Any]]:
    """Each prefill-only step the GPU ran priced by the simulator as its own forward
    (`step_price_ms`), against its device time, by search and `step_kind`: whether the replay charges
    the GPU's forwards what they took. `steps_of`: a search's step trace, None where it is
    not at hand (then the search is left out)."""
    rows = []
    for wl, pools in (gpu.get("results") or {}).items():
        for pool, by_policy in pools.items():
            for policy, reps in by_policy.items():
                for r in reps:
                    steps = steps_of(r) if isinstance(r, dict) and "max_qps" in r else None
                    if not steps:
                        continue
                    acc = {k: [0, 0.0, 0.0] for k in STEP_KINDS}  # steps, device ms, price ms
                    for st in steps:
                        n = int(st.get("num_prefill_seqs") or 0)
                        if not n or st.get("num_decodes") or st.get("device_ms") is None:
                            continue
                        price_ms, c = step_price_ms(st, service)
                        a = acc[step_kind(n, c)]
                        a[0] += 1
                        a[1] += st["device_ms"]
                        a[2] += price_ms
                    for kind, (num, device_ms, price_ms) in acc.items():
                        if num:
                            rows.append(
                                {
                                    "search": f"{wl}@{pool} {policy} r{r.get('repeat')}",
                                    "kind": kind,
                                    "num_steps": num,
                                    "device_ms": round(device_ms, 1),
                                    "price_ms": round(price_ms, 1),
                                    "device_over_price": device_ms / price_ms,
                                }
                            )
    return rows


def markdown_step_prices(rows: list[dict[str, Any]]) -> str:
    """`step_price_check` as a table (empty without the searches' step traces)."""
    if not rows:
        return ""
    lines = [
        "",
        "| search | step kind | steps | GPU device s | sim price s | GPU ÷ price, step by step |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['search']} | {r['kind']} | {r['num_steps']} | {r['device_ms'] / 1e3:.1f} "
            f"| {r['price_ms'] / 1e3:.1f} | {r['device_over_price']:.3f} |"
        )
    return "\n".join(lines)


def compare(
    gpu: dict[str, Any],
    setup: SimSetup,
    tokenizer: Any,
    srjf_options: dict[str, float] | None = None,
    step_overhead_s: float = 0.0,
    options: ReplayOptions | None = None,
) -> dict[str, Any]:
    replayer = Replayer(
        gpu,
        setup,
        tokenizer,
        srjf_options=srjf_options,
        step_overhead_s=step_overhead_s,
        options=options,
    )
    replayed = replayer.replay()
    rows = []
    for key, both in replayed.items():
        g, s = ratios(both["gpu"]), ratios(both["sim"])
        g_first, s_first = at_first_probe(both["gpu"]), at_first_probe(both["sim"])
        wl, pool = key.split("@")
        standard = run_experiment(
            wl,
            list(both["sim"]),
            [],
            scale=gpu["workloads"][wl]["scale"],
            setup=setup,
            cache_tokens=both["pool_tokens"],
            slo_p99_s=float(gpu["settings"]["slo_p99_ms"][wl]) / 1e3,
            prime=True,
        )["max_qps_at_slo"]
        for policy in both["sim"]:
            gr, sr = g.get(policy, {}).get("ratio_mean"), s[policy]["ratio_mean"]
            std_ratio = (
                standard[policy] / standard["fcfs"]
                if standard.get("fcfs") and policy in standard
                else None
            )
            rows.append(
                {
                    "workload": wl,
                    "pool": pool,
                    "pool_tokens": both["pool_tokens"],
                    "policy": policy,
                    "gpu_max_qps": g.get(policy, {}).get("max_qps"),
                    "sim_max_qps": s[policy]["max_qps"],
                    "gpu_ratio_to_fcfs": gr,
                    "sim_ratio_to_fcfs": sr,
                    "sim_ratio_relative_error": (sr / gr - 1.0) if gr and sr else None,
                    "within_20_percent": (abs(sr / gr - 1.0) <= 0.2) if gr and sr else None,
                    "sim_standard_protocol_max_qps": standard.get(policy),
                    "sim_standard_protocol_ratio_to_fcfs": std_ratio,
                    "gpu_p99_at_first_probe_over_fcfs": g_first.get(policy, {}).get("p99"),
                    "sim_p99_at_first_probe_over_fcfs": s_first[policy]["p99"],
                    "gpu_mean_at_first_probe_over_fcfs": g_first.get(policy, {}).get("mean"),
                    "sim_mean_at_first_probe_over_fcfs": s_first[policy]["mean"],
                    "gpu_hit_rate": g_first.get(policy, {}).get("hit_rate"),
                    "sim_hit_rate": s_first[policy]["hit_rate"],
                }
            )
    return {
        "rows": rows,
        "batch_model": batch_model_check(gpu, setup.service),
        "step_prices": step_price_check(gpu, setup.service, replayer.gpu_steps),
        "replayed": replayed,
    }


def issue_point(
    setup: SimSetup,
    scales: list[float],
    counts: list[int],
    seeds: list[int],
    tokenizer: Any,
    pool_fraction: float = 0.5,
    step_overheads_s: tuple[float, ...] = (0.0,),
) -> dict[str, Any]:
    """SRJF/FCFS ratios at 4 and 8 QPS under bench.compare's protocol (see the docstring)."""
    jct_models = {"fallback-default (refined online)": JCTModel(), "profile-fitted": None}
    rows = []
    for scale, step_s in [(sc, st) for sc in scales for st in step_overheads_s]:
        for seed in seeds:
            gen = WorkloadGenerator("post-recommendation", tokenizer, seed, scale, verify=False)
            pool = int(pool_fraction * sum(gen.group_prefix_tokens().values()))
            for n in counts:
                wl = from_bench_requests("post-recommendation", gen.take(n))
                for qps in ISSUE_POINT:
                    arrivals = arrival_times_s(qps, seed, 1.0, n, None)
                    for jname, template in jct_models.items():
                        got = {}
                        for policy in ("fcfs", "srjf"):
                            jct = setup.new_jct() if template is None else JCTModel()
                            lat: list[float] = []
                            st = simulate(
                                wl,
                                make_policy(policy, jct_model=jct),
                                qps,
                                service=setup.service,
                                cache_tokens=pool,
                                seed=seed,
                                jct_model=jct,
                                arrivals_s=arrivals,
                                latencies_out=lat,
                                step_overhead_s=step_s,
                            )
                            got[policy] = {
                                "mean": float(np.mean(lat)),
                                "p99": float(np.percentile(np.asarray(lat), 99)),
                                "completed_per_s": n / (st.makespan_s - arrivals[0]),
                            }
                        rows.append(
                            {
                                "scale": scale,
                                "step_overhead_s": step_s,
                                "seed": seed,
                                "num_requests": n,
                                "qps": qps,
                                "jct": jname,
                                **{
                                    k: got["srjf"][k] / got["fcfs"][k]
                                    for k in ("mean", "p99", "completed_per_s")
                                },
                                "fcfs_p99_s": got["fcfs"]["p99"],
                            }
                        )
    summary = []
    for scale, step_s in [(sc, st) for sc in scales for st in step_overheads_s]:
        for n in counts:
            for qps, gpu in ISSUE_POINT.items():
                for jname in jct_models:
                    sel = [
                        r
                        for r in rows
                        if r["scale"] == scale
                        and r["step_overhead_s"] == step_s
                        and r["num_requests"] == n
                        and r["qps"] == qps
                        and r["jct"] == jname
                    ]
                    entry = {
                        "scale": scale,
                        "step_overhead_s": step_s,
                        "num_requests": n,
                        "qps": qps,
                        "jct": jname,
                    }
                    for k in ("mean", "p99", "completed_per_s"):
                        vals = [r[k] for r in sel]
                        entry[k] = {
                            "sim_mean": statistics.fmean(vals),
                            "sim_min": min(vals),
                            "sim_max": max(vals),
                            "gpu": gpu.get(k),
                        }
                    summary.append(entry)
    return {
        "gpu_point": ISSUE_POINT,
        "pool_fraction": pool_fraction,
        "rows": rows,
        "summary": summary,
    }


def _fixed(v: Any, d: int = 2) -> str:
    """A table cell: `v` with `d` decimals, "-" for none."""
    return "-" if v is None else f"{v:.{d}f}"


def markdown_rows(rows: list[dict[str, Any]]) -> str:
    f = _fixed

    lines = [
        "| workload @ pool | policy | GPU max QPS (repeats) | sim max QPS (replay) | GPU ÷ FCFS "
        "| sim ÷ FCFS | sim error | sim ÷ FCFS, long primed runs "
        "| P99 at first probe ÷ FCFS, GPU / sim | mean there, GPU / sim | hit rate, GPU / sim |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g = ", ".join(f(x) for x in r["gpu_max_qps"] or []) or "-"
        s = ", ".join(f(x) for x in r["sim_max_qps"] or []) or "-"
        err = r["sim_ratio_relative_error"]
        lines.append(
            f"| {r['workload']} @ {r['pool']} | {r['policy']} | {g} | {s} "
            f"| {f(r['gpu_ratio_to_fcfs'])} | {f(r['sim_ratio_to_fcfs'])} "
            f"| {'-' if err is None else f'{err:+.0%}'} "
            f"| {f(r['sim_standard_protocol_ratio_to_fcfs'])} "
            f"| {f(r['gpu_p99_at_first_probe_over_fcfs'])} / "
            f"{f(r['sim_p99_at_first_probe_over_fcfs'])} "
            f"| {f(r['gpu_mean_at_first_probe_over_fcfs'])} / "
            f"{f(r['sim_mean_at_first_probe_over_fcfs'])} "
            f"| {f(r['gpu_hit_rate'])} / {f(r['sim_hit_rate'])} |"
        )
    return "\n".join(lines)


def markdown_followed(replayed: dict[str, Any]) -> str:
    """Follow mode: each GPU probe beside the replay's run of it, in the GPU's order."""

    def f(v: Any, d: int = 0) -> str:  # milliseconds: whole ones
        return _fixed(v, d)

    lines = [
        "| server | policy | repeat | QPS | mean ms, GPU / sim | P99 ms, GPU / sim "
        "| hit rate, GPU / sim | paired: front end / engine queue (sim queue) / after queue "
        "(sim forward) ms | GPU steps: device ÷ price, device share, idle ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, both in replayed.items():
        for policy, reps in both["sim"].items():
            for r in reps:
                for q, p in r["probes"].items():
                    pr = p.get("paired") or {}
                    paired = (
                        f"{f(pr.get('gpu_front_end_ms'))} / {f(pr.get('gpu_engine_queue_ms'))} "
                        f"({f(pr.get('sim_queue_ms'))}) / {f(pr.get('gpu_after_queue_ms'))} "
                        f"({f(pr.get('sim_forward_ms'))})"
                        if pr
                        else "-"
                    )
                    st = p.get("gpu_steps") or {}
                    steps = (
                        f"{f(st.get('device_over_price'), 3)}, "
                        f"{f(st.get('device_share_of_window'), 3)}, {f(st.get('idle_ms'))}"
                        if st
                        else "-"
                    )
                    lines.append(
                        f"| {key} | {policy} | {r['repeat']} | {float(q):g} "
                        f"| {f(p.get('gpu_mean_ms'))} / {f(p['mean_ms'])} "
                        f"| {f(p.get('gpu_p99_ms'))} / {f(p['p99_ms'])} "
                        f"| {f(p.get('gpu_hit_rate'), 2)} / {f(p['hit_rate'], 2)} | {paired} "
                        f"| {steps} |"
                    )
    return "\n".join(lines)


def markdown_predict(rows: list[dict[str, Any]]) -> str:
    f = _fixed

    lines = [
        "| server | policy | repeat | predicted max QPS | ÷ FCFS | P99 at FCFS's max ÷ FCFS |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lb = " (≥: every probe passed)" if r["all_probes_passed"] else ""
        lines.append(
            f"| {r['server']} | {r['policy']} | {r['repeat']} | {f(r['max_qps'])}{lb} "
            f"| {f(r['ratio_to_fcfs'])} | {f(r['p99_at_start_over_fcfs'])} |"
        )
    return "\n".join(lines)


def markdown_issue(data: dict[str, Any]) -> str:
    lines = [
        "| scale | step overhead (ms) | requests | QPS | scheduler JCT "
        "| mean SRJF÷FCFS sim [min, max] (GPU) | P99 SRJF÷FCFS sim (GPU) "
        "| completed/s SRJF÷FCFS sim (GPU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in data["summary"]:
        cells = []
        for k in ("mean", "p99", "completed_per_s"):
            v = e[k]
            gpu = "-" if v["gpu"] is None else f"{v['gpu']:.2f}"
            cells.append(f"{v['sim_mean']:.2f} [{v['sim_min']:.2f}, {v['sim_max']:.2f}] ({gpu})")
        lines.append(
            f"| {e['scale']:g} | {e['step_overhead_s'] * 1e3:g} | {e['num_requests']} "
            f"| {e['qps']:g} | {e['jct']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.sim_vs_gpu", description=__doc__.split("\n")[0]
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--gpu", help="a bench.gpu_scheduling results JSON")
    mode.add_argument("--issue-point", action="store_true")
    mode.add_argument(
        "--predict",
        action="store_true",
        help="predict a bench.gpu_scheduling run from its options (below) before it runs",
    )
    g = p.add_argument_group("--predict: the bench.gpu_scheduling options to predict")
    from bench import gpu_scheduling as gs

    g.add_argument("--parts", default=gs.DEFAULT_PARTS)
    g.add_argument("--scales-map", default=gs.DEFAULT_SCALES, help="its --scales")
    g.add_argument("--slo-ms", default=gs.DEFAULT_SLO_MS)
    g.add_argument("--start-qps", default=gs.DEFAULT_START_QPS)
    g.add_argument("--duration-s", type=float, default=14.0)
    g.add_argument("--max-probes", type=int, default=4)
    g.add_argument("--search-factor", type=float, default=1.5)
    g.add_argument(
        "--default-pool-blocks",
        type=int,
        default=54_000,
        help="KV blocks of a `default` pool (the H200 engine runs sized 53,805-55,713 for the "
        "8B model: bench/results/gpu-runtime-*.json, kv_pool_blocks)",
    )
    add_setup_args(p)
    p.add_argument("--tokenizer", help="for bench.workloads (default: the default model's)")
    p.add_argument("--scales", default="1,0.5", help="--issue-point: workload scales to try")
    p.add_argument("--num-requests", default="100,200", help="--issue-point: run lengths")
    p.add_argument("--seeds", default="0,1,2,3,4", help="--issue-point")
    p.add_argument(
        "--step-overheads-ms",
        default="0",
        help="--issue-point: host time per engine step to try (not measured yet; 0 = none)",
    )
    p.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="--gpu: host time added to every simulated forward of the replay (a what-if the "
        "GPU file does not state; recorded as step_overhead_what_if_ms; the long runs beside "
        "the replay keep none)",
    )
    add_plan_ahead_args(
        p,
        "--gpu: the replay plans each forward when the one before it starts, as the engine's "
        "overlapped scheduling does (recorded as plan_ahead; the long runs beside the replay "
        "keep the simulator's rule: chosen when the one before ends)",
    )
    p.add_argument(
        "--follow-gpu-probes",
        action="store_true",
        help="--gpu: run each search's GPU probes in the GPU's order instead of a search of "
        "the replay's own, so every probe compares (a table of them; max QPS is then the "
        "GPU's probes judged by the replay; recorded as follow_gpu_probes)",
    )
    p.add_argument(
        "--gpu-searches",
        help="--gpu: the folder of the searches' bench.serve files and step traces: each "
        "prefill step priced by the profile step by step (a table by kind); with "
        "--follow-gpu-probes their per-request records (bench.gpu_scheduling --per-request) "
        "are paired with the replay's by request id",
    )
    p.add_argument(
        "--srjf-fairness-lambda",
        type=float,
        help="--gpu: replay SRJF with this fairness offset instead of the one the servers ran "
        "(a what-if the GPU did not measure; recorded as srjf_what_if)",
    )
    p.add_argument(
        "--srjf-latency-slo-s",
        type=float,
        help="--gpu: replay SRJF with its offset derived from this latency SLO, as the engine's "
        "--ttft-slo-ms does (what-if)",
    )
    p.add_argument(
        "--forward-scales-what-if",
        help="--gpu: ONE,BATCH: the replay's one-request forwards cost ONE times the profile's "
        "price and its batched ones BATCH times (a what-if, e.g. the GPU's own steps against "
        "the price, the step-by-step table --gpu-searches prints; that table then reads the "
        "scaled price; recorded as forward_scales_what_if)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    scales = None
    if args.forward_scales_what_if:
        if not args.gpu:
            p.error("--forward-scales-what-if replays a --gpu file")
        try:
            one, batch = (float(x) for x in args.forward_scales_what_if.split(","))
        except ValueError:
            p.error("--forward-scales-what-if takes ONE,BATCH, e.g. 0.94,1.15")
        if not (one > 0 and batch > 0):
            p.error("--forward-scales-what-if: both scales must be > 0")
        scales = {"one_request": one, "batch": batch}
    what_if = {
        k: v
        for k, v in (
            ("fairness_lambda", args.srjf_fairness_lambda),
            ("latency_slo_s", args.srjf_latency_slo_s),
        )
        if v is not None
    }
    options = ReplayOptions.from_args(p, args)
    if args.step_overhead_ms and not args.gpu:
        p.error("--step-overhead-ms replays a --gpu file (--issue-point: --step-overheads-ms)")
    if what_if and not args.gpu:
        p.error("--srjf-fairness-lambda / --srjf-latency-slo-s replay a --gpu file")
    if len(what_if) > 1:
        p.error("give --srjf-fairness-lambda or --srjf-latency-slo-s, not both (SRJF takes one)")
    tok = load_tokenizer(args.tokenizer)
    if args.gpu:
        gpu = json.loads(Path(args.gpu).read_text())
        measured = (gpu.get("profile") or {}).get("path")
        if args.profile is None and args.service == "profile" and measured:
            local = Path(args.gpu).parent / Path(measured).name
            args.profile = str(local) if local.exists() else None
            if args.profile is None:
                print(
                    f"warning: the GPU run's profile {Path(measured).name} is not next to the "
                    f"results; using the default profile {DEFAULT_PROFILE.name}",
                    file=sys.stderr,
                )
        setup = _setup(args)
        if scales is not None:
            setup.service = ScaledForwards(setup.service, scales["one_request"], scales["batch"])
        data = compare(
            gpu,
            setup,
            tok,
            srjf_options=what_if,
            step_overhead_s=args.step_overhead_ms / 1e3,
            options=options,
        )
        data.update({"gpu_file": args.gpu, **setup.record, **options.record()})
        if args.step_overhead_ms:
            data["step_overhead_what_if_ms"] = args.step_overhead_ms
        if scales is not None:
            data["forward_scales_what_if"] = scales
        if what_if:
            # Not what the GPU ran: its SRJF used the server's defaults.
            data["srjf_what_if"] = what_if
        table = (
            markdown_rows(data["rows"])
            + markdown_batches(data["batch_model"])
            + markdown_step_prices(data["step_prices"])
        )
        if options.follow_gpu:
            table += "\n\n" + markdown_followed(data["replayed"])
    elif args.predict:
        setup = _setup(args)
        data = predict(args, setup, tok)
        data.update(setup.record)
        table = markdown_predict(data["rows"])
    else:
        setup = _setup(args)
        data = issue_point(
            setup,
            [float(x) for x in args.scales.split(",")],
            [int(x) for x in args.num_requests.split(",")],
            [int(x) for x in args.seeds.split(",")],
            tok,
            step_overheads_s=tuple(float(x) / 1e3 for x in args.step_overheads_ms.split(",")),
        )
        data.update(setup.record)
        table = markdown_issue(data)
    data["command"] = "python -m bench.sim_vs_gpu " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    from bench.serve import git_revision, machine_info

    # Simulator results depend on the code and the profile, not on the machine's speed; the
    # revision says which code, the machine only where it ran.
    data["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    data["git"] = git_revision()
    data["machine"] = machine_info()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(table)
    return 0


def markdown_batches(rows: list[dict[str, Any]]) -> str:
    """The batch-model check as a table (empty without step traces in the GPU file)."""
    if not rows:
        return ""
    lines = [
        "",
        "| search | batch band | steps | mean batch | new / cached tokens | GPU ms/req | "
        "sim ms/req | GPU / sim | profile device ms/req | GPU / profile device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["num_seqs"]
        dev = r.get("sim_device_ms_per_seq")
        dev_cells = (
            f"{dev:.2f} | {r['measured_over_sim_device']:.2f}" if dev is not None else "- | -"
        )
        lines.append(
            f"| {r['workload']}@{r['pool']} {r['policy']} r{r['repeat']} | "
            f"{low}-{high if high is not None else ''} | {r['num_steps']} | {r['mean_batch']} | "
            f"{r['new_tokens_per_seq']} / {r['context_tokens_per_seq']} | "
            f"{r['gpu_device_ms_per_seq']:.2f} | {r['sim_ms_per_seq']:.2f} | "
            f"{r['measured_over_sim']:.2f} | {dev_cells} |"
        )
    return "\n".join(lines)


def _setup(args: argparse.Namespace) -> SimSetup:
    return build_setup(
        service=args.service,
        profile_path=args.profile,
        jct_profile_path=args.jct_profile,
        calibration_path=args.calibration,
        noise_sigma=args.noise,
        online_refit=not args.no_online_refit,
    )


if __name__ == "__main__":
    raise SystemExit(main())
