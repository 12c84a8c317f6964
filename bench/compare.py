"""A/B comparison of two server configurations on one workload.

One server, switched through its admin API (the usual way):
`python -m bench.compare --url URL --a policy=fcfs --b policy=srjf --workload NAME --qps Q ...`
Two servers started with the two configurations:
`python -m bench.compare --url-a URL --url-b URL --workload NAME --rounds K --qps Q ...`

In each round both sides get the same requests at the same arrival times (round i draws its
requests with seed + i), in the order A B, B A, A B, ... (balanced pairs, so slow drift of the
machine, or of the server, does not favour one side). Before each side of each round the server's
prefix cache is emptied (`POST /admin/api/prefix-cache/reset`), so the second side of a round does
not find the first side's prompts cached; in one-server mode the side's settings (`PUT
/admin/api/partition`, `PUT /admin/api/policy`) are applied first. Printed: each metric's mean over
rounds for A and B, the ratio B/A, and the range of per-round ratios (how noisy it is).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.metrics import SLO
from bench.serve import (
    ClientOptions,
    add_common_args,
    admin_call,
    git_revision,
    machine_info,
    make_plan,
    options_from_args,
    parse_qps,
    reset_prefix_cache,
    resolve_model,
    run_once,
    run_record,
    server_info,
    warm_up,
    workload_record,
)
from bench.workloads import WorkloadGenerator, load_tokenizer

# (label, path into metrics); ratios are B / A.
COMPARED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TTFT mean (ms)", ("ttft_ms", "mean")),
    ("TTFT P99 (ms)", ("ttft_ms", "p99")),
    ("TPOT mean (ms)", ("tpot_ms", "mean")),
    ("TPOT P99 (ms)", ("tpot_ms", "p99")),
    ("ITL P99 (ms)", ("itl_ms", "p99")),
    ("E2EL mean (ms)", ("e2el_ms", "mean")),
    ("E2EL P99 (ms)", ("e2el_ms", "p99")),
    ("request throughput (req/s)", ("request_throughput",)),
    ("output throughput (tok/s)", ("output_throughput",)),
    (
        "output throughput while the closed loop was full (tok/s)",
        ("steady_state", "output_throughput"),
    ),
    ("goodput (req/s)", ("goodput",)),
    ("failed", ("failed",)),
)


def _get(metrics: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = metrics
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return None if value is None else float(value)


def summarize_ab(rounds_a: list[dict[str, Any]], rounds_b: list[dict[str, Any]]) -> list[dict]:
    """Per compared metric: mean over rounds of A and B, B/A of the means, per-round ratio range."""
    rows = []
    for label, path in COMPARED:
        a = [_get(m, path) for m in rounds_a]
        b = [_get(m, path) for m in rounds_b]
        if all(v is None for v in a + b):
            continue
        a_ok = [v for v in a if v is not None]
        b_ok = [v for v in b if v is not None]
        mean_a = float(np.mean(a_ok)) if a_ok else None
        mean_b = float(np.mean(b_ok)) if b_ok else None
        per_round = [
            y / x for x, y in zip(a, b, strict=True) if x is not None and y is not None and x > 0
        ]
        rows.append(
            {
                "metric": label,
                "a": mean_a,
                "b": mean_b,
                "ratio_b_over_a": (mean_b / mean_a) if mean_a and mean_b is not None else None,
                "round_ratio_min": min(per_round) if per_round else None,
                "round_ratio_max": max(per_round) if per_round else None,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]], name_a: str, name_b: str) -> str:
    def f(v: float | None, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    lines = [
        f"| metric | {name_a} (A) | {name_b} (B) | B/A | per-round B/A |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        spread = (
            f"{f(r['round_ratio_min'], 3)}..{f(r['round_ratio_max'], 3)}"
            if r["round_ratio_min"] is not None
            else "-"
        )
        lines.append(
            f"| {r['metric']} | {f(r['a'])} | {f(r['b'])} "
            f"| {f(r['ratio_b_over_a'], 3)} | {spread} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- one-server settings


@dataclass(frozen=True, slots=True)
class AdminChange:
    """One admin API change: `PUT path` with `body`."""

    path: str
    body: dict[str, Any]


def parse_settings(text: str) -> list[AdminChange]:
    """`"policy=fcfs,partition=static:64"` -> the admin calls that set it, in the given order.

    Keys: `policy` (srjf | spf | fcfs | srjf-oneshot; the server validates), `partition`
    (off | auto | static:<prefill_sms>), `budget` (prefill tokens per step, at most the
    server's start-up budget), `mixed` (tokens a step with decodes may take, or `none`),
    `share` (auto's chunks beside decodes grow past `mixed` until the step's fixed part is
    this share of it, or `none`: `--chunk-fixed-share`) and `tbt` (the TBT target in ms, or
    `none`): the last four in one `PUT /admin/api/prefill`, so a baseline's prefill budget is
    swept in one server run. `budget` without `mixed` is a fixed budget for every step, with
    or without decodes (the cap on steps with decodes is removed), as the `off-<k>` baselines
    have meant since they were first run; `budget` without `share` removes the share, so a
    side never inherits the one an earlier side set on the same server."""
    prefill: dict[str, Any] = {}
    changes: list[AdminChange] = []
    seen: set[str] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            raise ValueError(f"setting {item!r} is not key=value")
        if key in seen:
            raise ValueError(f"setting {key!r} given twice in {text!r}")
        seen.add(key)
        if key == "policy":
            changes.append(AdminChange("/admin/api/policy", {"policy": value}))
        elif key == "partition":
            mode, _, sms = value.partition(":")
            if mode == "static":
                if not sms.isdigit():
                    raise ValueError(f"partition=static needs :<prefill_sms>, got {value!r}")
                changes.append(
                    AdminChange("/admin/api/partition", {"mode": "static", "prefill_sms": int(sms)})
                )
            elif mode in ("off", "auto") and not sms:
                changes.append(AdminChange("/admin/api/partition", {"mode": mode}))
            else:
                raise ValueError(f"partition must be off, auto or static:<n>, got {value!r}")
        elif key == "budget":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"budget must be a positive token count, got {value!r}")
            prefill["prefill_token_budget"] = int(value)
        elif key == "mixed":
            if value.lower() == "none":
                prefill["mixed_step_token_budget"] = None
            elif value.isdigit() and int(value) >= 1:
                prefill["mixed_step_token_budget"] = int(value)
            else:
                raise ValueError(f"mixed must be a positive token count or none, got {value!r}")
        elif key == "share":
            if value.lower() == "none":
                prefill["chunk_fixed_share"] = None
            else:
                bad = ValueError(f"share must be between 0 and 1 or none, got {value!r}")
                try:
                    share = float(value)
                except ValueError:
                    raise bad from None
                if not 0.0 < share < 1.0:  # also refuses nan
                    raise bad
                prefill["chunk_fixed_share"] = share
        elif key == "tbt":
            try:
                prefill["tbt_slo_ms"] = None if value.lower() == "none" else float(value)
            except ValueError:
                raise ValueError(f"tbt must be milliseconds or none, got {value!r}") from None
        else:
            raise ValueError(
                f"unknown setting {key!r} (use policy=, partition=, budget=, mixed=, share=, tbt=)"
            )
    if "budget" in seen and "mixed" not in seen:
        prefill["mixed_step_token_budget"] = None
    if "budget" in seen and "share" not in seen:
        prefill["chunk_fixed_share"] = None
    if prefill:
        changes.append(AdminChange("/admin/api/prefill", prefill))
    if not changes:
        raise ValueError("empty settings")
    return changes


def _state_summary(state: dict[str, Any]) -> dict[str, Any]:
    """The parts of `/admin/api/state` that the settings change, as the server reports them."""
    part = state.get("partition") or {}
    return {
        "policy": (state.get("policy") or {}).get("current"),
        "partition": {k: part.get(k) for k in ("available", "mode", "prefill_sms", "decode_sms")},
        "prefill": state.get("prefill"),
    }


async def apply_settings(
    base_url: str, changes: list[AdminChange], admin_token: str | None
) -> dict[str, Any]:
    """Apply one side's settings; returns the server's state after the last change. A refused
    change ends the comparison (SystemExit): measuring the wrong configuration is worse than
    measuring nothing."""
    state: dict[str, Any] = {}
    for change in changes:
        ok, reply = await admin_call(base_url, "PUT", change.path, admin_token, change.body)
        if not ok:
            raise SystemExit(f"bench.compare: PUT {change.path} {change.body} failed: {reply}")
        assert isinstance(reply, dict)
        state = reply
    return _state_summary(state)


async def reset_or_exit(base_url: str, args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.reset_prefix_cache:
        return None
    reset = await reset_prefix_cache(base_url, args.admin_token)
    if not reset["done"]:
        raise SystemExit(
            f"bench.compare: prefix-cache reset failed on {base_url}: "
            f"{reset['error']} (pass --no-reset-prefix-cache to compare with warm "
            "caches knowingly)"
        )
    return reset


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n")[0])
    p.add_argument("--url", help="one server, switched between --a and --b settings")
    p.add_argument(
        "--a",
        dest="settings_a",
        help="side A settings, e.g. policy=fcfs or partition=off,policy=srjf (with --url)",
    )
    p.add_argument("--b", dest="settings_b", help="side B settings (with --url)")
    p.add_argument("--url-a", help="side A server (two-server mode)")
    p.add_argument("--url-b", help="side B server (two-server mode)")
    p.add_argument("--name-a", help="label of A (default: its settings, or 'A')")
    p.add_argument("--name-b", help="label of B (default: its settings, or 'B')")
    add_common_args(p)
    p.add_argument("--qps", required=True, help="one rate (or 'inf')")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="result JSON path")
    p.add_argument("--plot", help="PNG: both configurations' latencies (one point per round)")
    return p


@dataclass(slots=True)
class Side:
    key: str  # "a" | "b"
    name: str
    url: str
    opts: ClientOptions
    server: dict[str, Any]
    settings: str | None = None  # one-server mode: the settings text
    changes: list[AdminChange] | None = None
    runs: list[dict[str, Any]] | None = None


def check_mode(args: argparse.Namespace) -> str:
    """'one-server' or 'two-server'; SystemExit on a mix or a missing piece."""
    one = [args.url, args.settings_a, args.settings_b]
    two = [args.url_a, args.url_b]
    if any(one) and any(two):
        raise SystemExit("use either --url with --a/--b, or --url-a/--url-b, not both")
    if any(one):
        if not all(one):
            raise SystemExit("one-server mode needs --url, --a and --b")
        return "one-server"
    if not all(two):
        raise SystemExit("give --url with --a/--b (one server) or --url-a and --url-b")
    return "two-server"


async def make_sides(args: argparse.Namespace, mode: str, tok: Any) -> dict[str, Side]:
    sides: dict[str, Side] = {}
    for key in ("a", "b"):
        settings = getattr(args, f"settings_{key}")
        url = (args.url if mode == "one-server" else getattr(args, f"url_{key}")).rstrip("/")
        try:
            changes = parse_settings(settings) if settings is not None else None
        except ValueError as exc:
            raise SystemExit(f"--{key}: {exc}") from None
        name = getattr(args, f"name_{key}") or settings or key.upper()
        opts: ClientOptions = options_from_args(args, tok)
        info = await server_info(url, opts, args.admin_token)
        await resolve_model(url, opts, info)
        # Unrecorded warm-up, once per server (one-server mode: only before side A).
        if mode == "two-server" or key == "a":
            await warm_up(url, args, tok, opts)
        sides[key] = Side(key, name, url, opts, info, settings, changes, [])
    return sides


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    mode = check_mode(args)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    qps_values = parse_qps(args.qps)
    if len(qps_values) != 1:
        raise SystemExit("bench.compare takes one --qps value")
    qps = qps_values[0]
    slo = SLO.parse(args.slo)
    tok = load_tokenizer(args.tokenizer)
    gen = WorkloadGenerator(args.workload, tok, args.seed, args.scale)
    sides = await make_sides(args, mode, tok)
    for i in range(args.rounds):
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        # Fresh requests each round (seed + i; A and B get the same ones): repeating identical
        # prompts would turn every round after the first into full prefix-cache hits.
        round_gen = (
            gen
            if i == 0
            else WorkloadGenerator(args.workload, tok, args.seed + i, args.scale, pool=gen.pool)
        )
        plan = make_plan(round_gen, args, qps)
        for key in order:
            s = sides[key]
            applied = (
                await apply_settings(s.url, s.changes, args.admin_token)
                if s.changes is not None
                else None
            )
            # After the settings (a policy switch is queued on the engine like the reset) and
            # right before the side's first request.
            reset = await reset_or_exit(s.url, args)
            metrics, _ = await run_once(
                s.url, plan.requests, plan.arrivals_s, s.opts, slo, label=f"round {i + 1} {s.name}"
            )
            run = run_record(qps, metrics, plan, reset)
            run["round"] = i + 1
            run["position_in_round"] = order.index(key) + 1
            if applied is not None:
                run["server_settings"] = applied
            assert s.runs is not None
            s.runs.append(run)
    rows = summarize_ab(
        [r["metrics"] for r in sides["a"].runs or []], [r["metrics"] for r in sides["b"].runs or []]
    )

    def side_record(s: Side) -> dict[str, Any]:
        return {
            "name": s.name,
            "url": s.url,
            "settings": s.settings,
            "admin_changes": [{"path": c.path, "body": c.body} for c in s.changes or []],
            "server": s.server,
            "runs": s.runs,
        }

    return {
        "tool": "greenlane bench.compare",
        "command": shlex.join([Path(sys.executable).name, "-m", "bench.compare", *sys.argv[1:]]),
        "date": started,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_revision(),
        "machine": machine_info(),
        "mode": mode,
        "workload": workload_record(gen, args),
        "qps": "inf" if math.isinf(qps) else qps,
        "rounds": args.rounds,
        "slo": slo.as_dict() if slo else None,
        "prefix_cache_reset_before_each_side": args.reset_prefix_cache,
        "a": side_record(sides["a"]),
        "b": side_record(sides["b"]),
        "comparison": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    record = asyncio.run(main_async(args))
    name_a, name_b = record["a"]["name"], record["b"]["name"]
    print(format_table(record["comparison"], name_a, name_b))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"\nwrote {out}", file=sys.stderr)
    if args.plot:
        from bench.plots import plot_latency_vs_qps

        # Rounds sit at the same QPS: plotted as points at that QPS, one colour per side.
        label_a, label_b = (
            (name_a, name_b) if name_a != name_b else (f"{name_a} (A)", f"{name_b} (B)")
        )
        plot_latency_vs_qps(
            {label_a: record["a"]["runs"], label_b: record["b"]["runs"]},
            args.plot,
            title=f"{args.workload}: {name_a} vs {name_b}",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
