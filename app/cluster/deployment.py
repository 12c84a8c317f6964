"""The Ray Serve deployments: replicas, their directory, and `build_app(config)`.

* `GreenlaneReplica` — one Greenlane server (one engine, one GPU: `num_gpus=1` on a GPU
  cluster) per replica; `forward()` streams raw HTTP through it (app/cluster/replica.py).
  `check_health` fails when the engine loop died, so Ray replaces the replica;
  `record_routing_stats` feeds the router.
* `ClusterDirectory` — one tiny replica (no CPU) that every replica reports its stats to every
  `routing_stats_period_s`. The ingress reads it for `/metrics`, `/cluster/replicas` and
  `/health`, and asks for a prefix-cache reset on every replica through it (an epoch that
  replicas apply and acknowledge in their next report), whichever router is in use.
* The ingress (app/cluster/ingress.py) is the only deployment with an HTTP route.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from app.cluster.config import REPLICA_SETTINGS_EXCLUDE, ClusterConfig
from app.cluster.replica import GreenlaneServer

log = logging.getLogger("greenlane.cluster")

REPORT_STALE_AFTER_PERIODS = 3.0


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class ClusterDirectory:
    """Latest stats of every live replica, and the prefix-cache reset epoch."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Any]] = {}
        self._reset_epoch = 0

    def report(self, replica_id: str, stats: dict[str, Any]) -> int:
        """Store one replica's stats; returns the reset epoch it should be at."""
        self._reports[replica_id] = {**stats, "received_at_s": time.time()}
        return self._reset_epoch

    def forget(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)

    def snapshot(self, max_age_s: float) -> dict[str, dict[str, Any]]:
        """Reports newer than `max_age_s` (older ones are dead or stuck replicas: dropped)."""
        now = time.time()
        for rid in [r for r, s in self._reports.items() if now - s["received_at_s"] > max_age_s]:
            del self._reports[rid]
        return dict(self._reports)

    def request_reset(self) -> int:
        self._reset_epoch += 1
        return self._reset_epoch


class GreenlaneReplica:
    """One replica: a Greenlane server on a loopback port, reached over raw HTTP."""

    async def __init__(
        self, settings: dict[str, Any], directory: DeploymentHandle, report_period_s: float
    ) -> None:
        ctx = serve.get_replica_context()
        self.replica_id: str = ctx.replica_id.unique_id
        # Loading a model takes seconds: not on the replica's event loop.
        self._server = await asyncio.to_thread(GreenlaneServer, settings)
        self._directory = directory
        self._report_period_s = report_period_s
        self._reset_epoch_done = 0
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            try:
                stats = self.stats()
                epoch = await self._directory.report.remote(self.replica_id, stats)
                if epoch > self._reset_epoch_done:
                    await asyncio.to_thread(self._server.reset_prefix_cache)
                    self._reset_epoch_done = epoch
                    continue  # acknowledge at once
            except asyncio.CancelledError:
                raise
            except Exception:  # the directory is being replaced: keep serving, retry later
                log.warning("replica %s: stats report failed", self.replica_id, exc_info=True)
            await asyncio.sleep(self._report_period_s)

    def stats(self) -> dict[str, Any]:
        return {
            **self._server.routing_stats(),
            "replica_id": self.replica_id,
            "reset_epoch_done": self._reset_epoch_done,
        }

    # ---- Ray Serve hooks ---------------------------------------------------------------------
    async def record_routing_stats(self) -> dict[str, Any]:
        return self.stats()

    async def check_health(self) -> None:
        if not self._server.is_alive():
            raise RuntimeError("the Greenlane engine loop is not running")

    async def __del__(self) -> None:
        self._reporter.cancel()
        await asyncio.to_thread(self._server.shutdown)

    # ---- requests ----------------------------------------------------------------------------
    async def forward(
        self,
        route_key: str | None,
        method: str,
        path: str,
        query: str,
        headers: list[tuple[str, str]],
        body: bytes,
        avoid: str | None = None,
    ) -> AsyncIterator[Any]:
        """Stream one HTTP exchange: the head `{"status", "headers", "replica_id"}`, then body
        chunks. `route_key` and `avoid` (a replica that just answered 503 to this request)
        are read by the router only (app/cluster/router.py)."""
        first = True
        async for item in self._server.forward(method, path, query, headers, body):
            if first:
                item = {**item, "replica_id": self.replica_id}
                first = False
            yield item


def replica_deployment(config: ClusterConfig) -> Any:
    """`GreenlaneReplica` with this config's resources, scaling, admission and router."""
    router_config = None
    if config.router == "affinity":
        aff = config.affinity()
        router_config = RequestRouterConfig(
            request_router_class="app.cluster.router:PrefixAffinityRouter",
            request_router_kwargs={
                "max_queue_gap": aff.max_queue_gap,
                "max_backlog_gap_s": aff.max_backlog_gap_s,
                "prefix_tokens": aff.prefix_tokens,
                "prefix_chars": aff.prefix_chars,
            },
            request_routing_stats_period_s=config.routing_stats_period_s,
        )
    else:  # Ray's default power-of-two router, still fed our stats for the cluster state
        router_config = RequestRouterConfig(
            request_routing_stats_period_s=config.routing_stats_period_s
        )
    options: dict[str, Any] = {
        "name": "GreenlaneReplica",
        "ray_actor_options": {
            "num_cpus": config.replica_num_cpus,
            "num_gpus": config.replica_num_gpus,
        },
        "max_ongoing_requests": config.max_ongoing_requests or config.replica_admission_limit(),
        "max_queued_requests": config.max_queued_requests,
        "health_check_period_s": config.health_check_period_s,
        "health_check_timeout_s": config.health_check_timeout_s,
        "request_router_config": router_config,
        # A replica drains like `greenlane serve` on SIGTERM: its running requests finish.
        "graceful_shutdown_timeout_s": float(config.replica_settings.get("shutdown_grace_s", 10.0))
        + 5.0,
    }
    if config.num_replicas is not None:
        options["num_replicas"] = config.num_replicas
    else:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=config.min_replicas,
            max_replicas=config.max_replicas,
            target_ongoing_requests=config.target_ongoing_requests,
        )
    return serve.deployment(GreenlaneReplica).options(**options)


def build_app(config: ClusterConfig) -> Any:
    """The Serve application: ingress -> replicas (+ the directory both talk to)."""
    from app.cluster.ingress import GreenlaneIngress

    directory = ClusterDirectory.bind()
    replicas = replica_deployment(config).bind(
        dict(config.replica_settings), directory, config.routing_stats_period_s
    )
    ingress = GreenlaneIngress.options(
        num_replicas=config.ingress_replicas,
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
    )
    return ingress.bind(replicas, directory, config)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve config files' entry (`import_path: app.cluster.deployment:app_builder`, as in
    deploy/rayservice.yaml): `args` holds `ClusterConfig` fields, and `replica_settings` the
    replicas' `Settings` fields (model, engine and server options)."""
    from app.settings import Settings

    fields = dict(args)
    settings = Settings(**dict(fields.pop("replica_settings", {}) or {}))
    settings.to_engine_config(resolve_calibration=False)  # bad options fail the deploy, clearly
    replica_settings = settings.model_dump(exclude=set(REPLICA_SETTINGS_EXCLUDE))
    config = ClusterConfig(replica_settings=replica_settings, **fields)
    return build_app(config)
