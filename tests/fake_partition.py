"""Test-only stand-ins for the admin tests. Nothing here is used by the product.

- `FakePartition`: a `runtime.partition.PartitionManager` that pretends to be a 132-SM GPU with
  pre-created prefill splits [32, 48, 64, 80, 96], so the admin API and page can be driven on CPU.
  Its "predicted"/"measured" latencies are made-up numbers derived from the split, only so the
  page has something to draw; they say nothing about any GPU.
- `FakeEngine` / `FakeMetrics`: the slice of `runtime.engine.Engine` and the app's metrics that
  `app/admin.py` reads, with a tiny background "server" thread that turns submitted jobs into
  queue depths, KV usage and latency samples. Used when the real app factory is not importable.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from policies import POLICY_NAMES
from runtime.config import check_prefill_limits
from runtime.partition import PartitionState

FAKE_TOTAL_SMS = 132
FAKE_SPLITS = [32, 48, 64, 80, 96]


class FakePartition:
    """Pretend green-context partition manager (see module docstring)."""

    def __init__(self, total_sms: int = FAKE_TOTAL_SMS, splits: list[int] | None = None) -> None:
        self._lock = threading.Lock()
        self.total_sms = total_sms
        self.splits = list(splits if splits is not None else FAKE_SPLITS)
        self.mode = "off"
        self.prefill_sms = total_sms
        self.pinned = False
        self.calls: list[str] = []  # every spec given to set_mode, for assertions
        # What GreenContextPartition reports about auto's choices and failed splits; tests set
        # them directly (no fake controller runs here).
        self.choice_counts: dict[str, int] = {}
        self.disabled_splits: dict[str, str] = {}
        self.error_resets = 0  # reset_cost_model_errors calls

    def _split_state(self) -> PartitionState:
        if self.mode == "off":
            prefill, decode = self.total_sms, self.total_sms  # time-sliced: both use all SMs
        else:
            prefill, decode = self.prefill_sms, self.total_sms - self.prefill_sms
        # Made-up latencies: inversely proportional to the SM share, "measured" 8% slower.
        pred_prefill = 40.0 * self.total_sms / prefill
        pred_decode = 6.0 * self.total_sms / decode
        return PartitionState(
            available=True,
            reason="",
            mode=self.mode,
            total_sms=self.total_sms,
            prefill_sms=prefill,
            decode_sms=decode,
            splits=list(self.splits),
            pinned=self.pinned,
            predicted_prefill_ms=pred_prefill,
            predicted_decode_ms=pred_decode,
            measured_prefill_ms=pred_prefill * 1.08,
            measured_decode_ms=pred_decode * 1.08,
            choice_counts=dict(self.choice_counts),
            disabled_splits=dict(self.disabled_splits),
        )

    def state(self) -> PartitionState:
        with self._lock:
            return self._split_state()

    def reset_cost_model_errors(self) -> bool:
        with self._lock:
            self.error_resets += 1
        return True

    def set_mode(self, spec: str) -> PartitionState:
        with self._lock:
            self.calls.append(spec)
            self.choice_counts = {}
            if spec == "off":
                self.mode, self.prefill_sms, self.pinned = "off", self.total_sms, False
            elif spec == "auto":
                # A fake controller: starts from the middle split; the pin is released.
                self.mode, self.pinned = "auto", False
                self.prefill_sms = self.splits[len(self.splits) // 2]
            elif spec.startswith("static:"):
                try:
                    sms = int(spec[len("static:") :])
                except ValueError:
                    raise ValueError(f"malformed partition spec {spec!r}") from None
                if sms not in self.splits:
                    raise ValueError(
                        f"prefill_sms={sms} is not a pre-created split; choose one of {self.splits}"
                    )
                self.mode, self.prefill_sms, self.pinned = "static", sms, True
            else:
                raise ValueError(
                    f"partition must be off, auto or static:<prefill_sms>, got {spec!r}"
                )
            return self._split_state()


class AsyncPartition:
    """A partition manager as the front end sees it (app/engine_view.py): `state()` at once,
    `set_mode` a coroutine. Other attributes (e.g. `calls`) reach the wrapped manager."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager

    def state(self) -> PartitionState:
        return self._manager.state()

    async def set_mode(self, spec: str) -> PartitionState:
        return self._manager.set_mode(spec)

    async def reset_cost_model_errors(self) -> bool:
        return self._manager.reset_cost_model_errors()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_manager":
            object.__setattr__(self, name, value)
        else:
            setattr(self._manager, name, value)


class FakeMetrics:
    """The `recent()` interface `app/admin.py` expects from `app.state.metrics`."""

    def __init__(self, window: int = 512) -> None:
        self._lock = threading.Lock()
        self.ttft_s: deque[float] = deque(maxlen=window)
        self.tpot_s: deque[float] = deque(maxlen=window)
        self.e2e_s: deque[float] = deque(maxlen=window)
        self.completed_total = 0
        self.tokens_total = 0

    def record(self, ttft_s: float, tpot_s: float, e2e_s: float, num_tokens: int) -> None:
        with self._lock:
            self.ttft_s.append(ttft_s)
            self.tpot_s.append(tpot_s)
            self.e2e_s.append(e2e_s)
            self.completed_total += 1
            self.tokens_total += num_tokens

    def recent(self) -> dict[str, Any]:
        with self._lock:
            return {
                "ttft_s": list(self.ttft_s),
                "tpot_s": list(self.tpot_s),
                "e2e_s": list(self.e2e_s),
                "completed_total": self.completed_total,
                "tokens_total": self.tokens_total,
            }


class FakeEngine:
    """Enough of `runtime.engine.Engine` for the admin router, plus a toy job server.

    `submit(num_tokens)` queues a job; a background thread admits up to `max_running` jobs,
    "prefills" for `prefill_s`, then "decodes" one token every `tpot_s`. It exists so the admin
    page's numbers can move in a test without a model; it models no real engine behaviour."""

    def __init__(
        self,
        partition: Any = None,
        *,
        max_running: int = 4,
        prefill_s: float = 0.15,
        tpot_s: float = 0.01,
        metrics: FakeMetrics | None = None,
    ) -> None:
        self.partition = partition if partition is not None else FakePartition()  # type: ignore[assignment]
        self.metrics = metrics if metrics is not None else FakeMetrics()
        self.policy = "srjf"
        self.policy_calls: list[str] = []
        self.prefill_budget_cap = 8192  # the budget the server "started" with
        self.prefill_limits: tuple[int, float | None] = (8192, None)
        self.mixed_step_token_budget: int | None = 2048
        self.chunk_fixed_share: float | None = None
        self.max_running = max_running
        self.prefill_s, self.tpot_s = prefill_s, tpot_s
        self.kv_blocks_total = 256
        self._lock = threading.Lock()
        self._waiting: deque[tuple[float, int]] = deque()  # (arrival monotonic s, num_tokens)
        self._running: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def partition(self) -> AsyncPartition:
        return self._partition

    @partition.setter
    def partition(self, manager: Any) -> None:
        self._partition = AsyncPartition(manager)

    # --- the EngineView contract used by app/admin.py ---
    def stats(self) -> dict[str, Any]:
        with self._lock:
            used = sum(int(job["blocks"]) for job in self._running)
            return {
                "num_waiting": len(self._waiting),
                "num_running": len(self._running),
                "kv_blocks_used": used,
                "kv_blocks_total": self.kv_blocks_total,
                "prefix_hit_tokens": 0,
                "prefix_query_tokens": 0,
                "policy": self.policy,
                "prefill_token_budget": self.prefill_limits[0],
                "tbt_slo_ms": self.prefill_limits[1],
                "mixed_step_token_budget": self.mixed_step_token_budget,
                "chunk_fixed_share": self.chunk_fixed_share,
                "prefill_chunk_tokens": 16384,
                "num_failed_steps": 3,
                "num_failed_requests": 1,
                "num_preemptions": 4,
                "num_chunked_scoring": 5,
                "pd_layer_sliced_prefills": 6,
                "pd_sub_layer_sliced_prefills": 2,
                "fallbacks": {"prefill graphs": "stand-in: out of memory"},
                "kernels_compiled_while_serving": 2,
                "num_drains_before_held_launch": 1,
            }

    async def set_policy(self, name: str) -> None:
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown prefill policy {name!r}")
        self.policy_calls.append(name)
        self.policy = name

    async def set_prefill_limits(
        self,
        prefill_token_budget: int,
        tbt_slo_ms: float | None,
        mixed_step_token_budget: int | None,
        chunk_fixed_share: float | None,
    ) -> None:
        check_prefill_limits(
            prefill_token_budget,
            tbt_slo_ms,
            mixed_step_token_budget,
            self.prefill_budget_cap,
            chunk_fixed_share,
        )
        self.prefill_limits = (prefill_token_budget, tbt_slo_ms)
        self.mixed_step_token_budget = mixed_step_token_budget
        self.chunk_fixed_share = chunk_fixed_share

    async def reset_prefix_cache(self) -> None:
        return None

    def is_alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    # --- the toy job server ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    def shutdown(self, grace_s: float = 0.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def submit(self, num_tokens: int) -> None:
        with self._lock:
            self._waiting.append((time.monotonic(), num_tokens))

    def _loop(self) -> None:
        while not self._stop.wait(0.005):
            now = time.monotonic()
            with self._lock:
                while self._waiting and len(self._running) < self.max_running:
                    arrival, num_tokens = self._waiting.popleft()
                    self._running.append(
                        {
                            "arrival": arrival,
                            "first_token": now + self.prefill_s,
                            "done": now + self.prefill_s + num_tokens * self.tpot_s,
                            "tokens": num_tokens,
                            "blocks": 8 + num_tokens // 4,
                        }
                    )
                finished = [job for job in self._running if job["done"] <= now]
                self._running = [job for job in self._running if job["done"] > now]
            for job in finished:
                self.metrics.record(
                    ttft_s=job["first_token"] - job["arrival"],
                    tpot_s=self.tpot_s,
                    e2e_s=job["done"] - job["arrival"],
                    num_tokens=int(job["tokens"]),
                )
