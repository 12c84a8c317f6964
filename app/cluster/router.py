"""`PrefixAffinityRouter`: Ray Serve's request-router API around `app.cluster.routing.choose`.

Ray calls `choose_replicas(candidates, pending_request)` for each request the ingress sends to
the replica deployment and tries the returned ranks in order (within a rank, the replica with
the shortest queue that accepts). The ingress passes the routing key as the first argument of
`GreenlaneReplica.forward`, so the router reads it without parsing the body again.

Loads: `queue` is Ray's count of requests in flight on the replica (its queue-length cache,
updated on every send and completion; probed when missing), which is fresh. Predicted prefill
backlog and KV usage come from the replica's routing stats (`record_routing_stats`, every
`request_routing_stats_period_s`), so they lag by up to one period.

No FIFOMixin on purpose: with it, a replica chosen for one request's key may be handed to an
older pending request with another key.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from app.cluster.routing import AffinityConfig, KeyHomes, ReplicaLoad, choose

log = logging.getLogger("greenlane.cluster")


def key_of(pending_request: PendingRequest | None) -> str | None:
    """The routing key the ingress put first in `forward`'s arguments (None: no affinity)."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, str) else None


class PrefixAffinityRouter(RequestRouter):
    """Same key -> same replica while its load is within a bound of the least-loaded one;
    otherwise, and for requests without a key, power of two choices."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._affinity = AffinityConfig(**kwargs)
        self._rng = random.Random()
        self._homes = KeyHomes()
        self.num_home = self.num_spill = self.num_no_key = 0

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        lens: dict[ReplicaID, int] = {}
        missing: list[RunningReplica] = []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id)
            if q is None:
                missing.append(r)
            else:
                lens[r.replica_id] = q
        if missing:
            # Private in Ray (as used by its own prefix-aware router): one probe round.
            for r, q in await self._probe_queue_lens(missing, 0):
                if q is not None:
                    lens[r.replica_id] = q
        return lens

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every rank we return already covers the fallbacks: if all of them refuse, wait
            # (Ray's backoff) before asking again instead of spinning.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        key = key_of(pending_request)
        avoid = pending_request.kwargs.get("avoid") if pending_request is not None else None
        if avoid is not None and len(candidate_replicas) > 1:
            # A retry after that replica answered 503 (its engine is dead or it is draining).
            others = [r for r in candidate_replicas if r.replica_id.unique_id != avoid]
            candidate_replicas = others or candidate_replicas
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if key is None or len(candidate_replicas) == 1:
            queue_lens: dict[ReplicaID, int] = {}
        else:
            queue_lens = await self._queue_lens(candidate_replicas)
        loads: dict[str, ReplicaLoad] = {}
        for uid, r in by_id.items():
            if key is not None and r.replica_id not in queue_lens and len(by_id) > 1:
                continue  # no answer to the probe: not a candidate this round
            stats = r.routing_stats or {}
            backlog = stats.get("prefill_backlog_s")
            loads[uid] = ReplicaLoad(
                queue=queue_lens.get(r.replica_id, 0),
                prefill_backlog_s=float(backlog) if isinstance(backlog, int | float) else None,
                kv_usage=stats.get("kv_usage"),
            )
        if not loads:
            return []
        choice = choose(key, loads, self._affinity, self._rng, self._homes)
        if choice.reason == "home":
            self.num_home += 1
        elif choice.reason == "spill":
            self.num_spill += 1
        elif choice.reason == "no-key":
            self.num_no_key += 1
        return [[by_id[uid] for uid in rank] for rank in choice.ranks if rank]
