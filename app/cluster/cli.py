"""`greenlane cluster` / `python -m app.cluster`: Greenlane replicas on Ray Serve.

    python -m app.cluster --replicas 2 --model random:tiny                 # a local Ray cluster
    python -m app.cluster --address auto --replicas 8 --replica-num-gpus 1 --model /models/x
    python -m app.cluster --address auto --min-replicas 2 --max-replicas 8 --replica-num-gpus 1

Without `--address` a local Ray cluster is started in this process (loopback only) and stopped
on exit; with `--address auto` (or `ray://...`, `HOST:PORT`) the application is deployed on a
running cluster. Runs until SIGINT/SIGTERM, then deletes the application. Every `serve` option
(`--model`, `--max-queue`, `--prefill-policy`, ...) and its `GREENLANE_*` variable applies to
each replica.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from app.cluster.config import REPLICA_SETTINGS_EXCLUDE, ROUTERS, ClusterConfig

log = logging.getLogger("greenlane.cluster")

REPO_DIR = Path(__file__).resolve().parent.parent.parent


def connect_ray(address: str | None, num_cpus: float | None = None, num_gpus: int | None = None):
    """Join a running Ray cluster (`address`) or start a local one bound to loopback.

    Local workers get this checkout on PYTHONPATH so they import the same `app` package."""
    import ray

    if ray.is_initialized():
        return
    pythonpath = os.pathsep.join(p for p in (str(REPO_DIR), os.environ.get("PYTHONPATH")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": pythonpath}}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        # Loopback only: a local cluster serves this machine and talks to nothing else.
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        runtime_env=runtime_env,
        object_store_memory=200 * 1024 * 1024,
    )


def deploy(
    config: ClusterConfig,
    host: str,
    port: int,
    blocking_timeout_s: float = 600.0,
    log_level: str = "WARNING",
) -> str:
    """Start Serve's HTTP proxy on host:port and run the application; returns its base URL.

    `log_level` is Serve's for the deployments (INFO logs a line per request and per stats
    report)."""
    from ray import serve

    from app.cluster.deployment import build_app

    serve.start(http_options={"host": host, "port": port})
    serve.run(
        build_app(config),
        name=config.app_name,
        route_prefix=config.route_prefix,
        blocking=False,
        logging_config={"log_level": log_level.upper()},
    )
    _wait_running(config.app_name, blocking_timeout_s)
    return f"http://{host}:{port}{config.route_prefix.rstrip('/')}"


def _wait_running(app_name: str, timeout_s: float) -> None:
    import time

    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(app_name)
        state = getattr(status, "status", None)
        if state == "RUNNING":
            return
        if state in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"application {app_name!r} {state}: {status.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"application {app_name!r} not running after {timeout_s} s")
        time.sleep(0.2)


def build_parser() -> argparse.ArgumentParser:
    from app.cli import _add_settings_options  # every `serve` option, for the replicas
    from app.settings import Settings

    p = argparse.ArgumentParser(
        prog="greenlane cluster",
        description="Serve Greenlane replicas (one engine and one GPU each) behind one "
        "OpenAI-compatible endpoint on Ray Serve, routed by prefix affinity.",
    )
    c = p.add_argument_group("cluster")
    c.add_argument("--address", default=None, help="Ray cluster to join (default: start one)")
    c.add_argument("--app-name", default="greenlane")
    n = c.add_mutually_exclusive_group()
    n.add_argument("--replicas", type=int, default=None, help="fixed replica count (default 1)")
    n.add_argument("--min-replicas", type=int, default=None, help="autoscaling lower bound")
    c.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound")
    c.add_argument("--target-ongoing-requests", type=float, default=16.0)
    c.add_argument("--replica-num-cpus", type=float, default=1.0)
    c.add_argument(
        "--replica-num-gpus", type=float, default=None, help="default: 1 when Ray sees GPUs, else 0"
    )
    c.add_argument("--router", choices=ROUTERS, default="affinity")
    c.add_argument("--max-queue-gap", type=int, default=8, help="affinity bound, requests")
    c.add_argument(
        "--max-backlog-gap-s",
        type=float,
        default=2.0,
        help="affinity bound on predicted prefill backlog, s (negative: ignore backlog)",
    )
    c.add_argument("--route-prefix-tokens", type=int, default=256)
    c.add_argument("--route-prefix-chars", type=int, default=1024)
    c.add_argument("--routing-stats-period-s", type=float, default=1.0)
    c.add_argument("--max-ongoing-requests", type=int, default=None)
    c.add_argument("--max-queued-requests", type=int, default=256)
    c.add_argument("--ingress-replicas", type=int, default=1)
    c.add_argument("--num-cpus", type=float, default=None, help="local Ray cluster: CPUs")
    r = p.add_argument_group("replica options (as for `greenlane serve`)")
    names = [n for n in Settings.model_fields if n not in ("host", "port")]
    _add_settings_options(r, names)
    # The cluster's own address (Serve's HTTP proxy); replicas pick loopback ports themselves.
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    return p


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    from app.settings import Settings

    cluster_keys = {
        "address", "app_name", "replicas", "min_replicas", "max_replicas",
        "target_ongoing_requests", "replica_num_cpus", "replica_num_gpus", "router",
        "max_queue_gap", "max_backlog_gap_s", "route_prefix_tokens", "route_prefix_chars",
        "routing_stats_period_s", "max_ongoing_requests", "max_queued_requests",
        "ingress_replicas", "num_cpus", "host", "port",
    }  # fmt: skip
    overrides = {k: v for k, v in vars(args).items() if k not in cluster_keys}
    # Resolve env + flags here, once: replicas run elsewhere and must not see another env.
    settings = Settings(**overrides)
    settings.to_engine_config(resolve_calibration=False)  # validate before deploying
    replica_settings = settings.model_dump(exclude=set(REPLICA_SETTINGS_EXCLUDE))
    num_gpus = args.replica_num_gpus
    if num_gpus is None:
        import ray

        num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    autoscale = args.min_replicas is not None
    return ClusterConfig(
        replica_settings=replica_settings,
        app_name=args.app_name,
        num_replicas=None if autoscale else (args.replicas or 1),
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas if autoscale else None,
        target_ongoing_requests=args.target_ongoing_requests,
        replica_num_cpus=args.replica_num_cpus,
        replica_num_gpus=num_gpus,
        router=args.router,
        max_queue_gap=args.max_queue_gap,
        max_backlog_gap_s=None if args.max_backlog_gap_s < 0 else args.max_backlog_gap_s,
        route_prefix_tokens=args.route_prefix_tokens,
        route_prefix_chars=args.route_prefix_chars,
        routing_stats_period_s=args.routing_stats_period_s,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        ingress_replicas=args.ingress_replicas,
        retry_after_s=settings.retry_after_s,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.max_replicas is not None and args.min_replicas is None:
        print("greenlane cluster: --max-replicas needs --min-replicas", file=sys.stderr)
        return 2
    connect_ray(args.address, num_cpus=args.num_cpus)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"greenlane cluster: invalid option: {exc}", file=sys.stderr)
        return 2
    from ray import serve

    url = deploy(config, args.host, args.port)
    print(f"greenlane cluster: serving {config.app_name!r} at {url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping: deleting application %r", config.app_name)
    serve.delete(config.app_name)
    if args.address is None:
        serve.shutdown()
    return 0
