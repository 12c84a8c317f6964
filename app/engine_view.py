"""What routes and the admin API see of the engine: its limits, tokenizer and stats, and its
controls, as plain front-end objects over the engine core client (no tensors, no engine here).

`app.state.engine` is an `EngineView`. Limits and the tokenizer come from the engine's `info()`
at start-up; `stats()` and `partition.state()` from the latest heartbeat (at most 0.2 s old);
controls (`set_policy`, `reset_prefix_cache`, `partition.set_mode`, `shutdown`) are calls to
the engine core: coroutines, since they cross a process boundary.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import ValidationError

from app.protocol import _SamplingFields
from runtime.partition import PartitionState
from runtime.tokenizer import Tokenizer


def load_frontend_tokenizer(info: dict[str, Any]) -> Any:
    """The tokenizer the engine uses: its object when the engine sent one (test engines),
    else loaded from the engine's tokenizer folder."""
    tok = info.get("tokenizer")
    if tok is not None:
        return tok
    return Tokenizer.from_dir(info["tokenizer_dir"])


# generation_config.json keys that are sampling defaults (checked as a request's would be).
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_sampling_defaults(info: dict[str, Any]) -> tuple[dict[str, float], list[str]]:
    """The sampling defaults the model ships in its `generation_config.json` (temperature,
    top_p, top_k, min_p, repetition_penalty: what vLLM applies by default, so a request that
    leaves them out samples as the model's authors meant), and a note for each value that is
    not one a request could set (left out). Random presets have none (their tokenizer folder
    is another model's)."""
    if str(info.get("model", "")).startswith("random:") or "tokenizer_dir" not in info:
        return {}, []
    path = Path(info["tokenizer_dir"]) / "generation_config.json"
    if not path.is_file():
        return {}, []
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {}, [f"{path} could not be read ({exc}): no sampling defaults taken from it"]
    found: dict[str, float] = {}
    notes: list[str] = []
    for key in _SAMPLING_DEFAULT_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        try:  # the request model's own bounds: a default no request could set is not used
            _SamplingFields.model_validate({key: value})
        except ValidationError as exc:
            why = exc.errors()[0].get("msg", "invalid")
            notes.append(
                f"{path}: {key}={value!r} is not a value a request may set ({why}): not used"
            )
            continue
        found[key] = int(value) if key == "top_k" else float(value)
    return found, notes


class PartitionView:
    def __init__(self, core: Any) -> None:
        self._core = core

    def state(self) -> PartitionState:
        st = self._core.partition_state()
        if not st:
            return PartitionState(False, "the engine is starting", "off", 0, 0, 0)
        return PartitionState(**st)

    async def set_mode(self, spec: str) -> PartitionState:
        """Raises ValueError (from the engine) for a spec it cannot apply."""
        state = await self._core.call("set_partition", spec)
        self._core.note(partition=state)  # seen at once, before the next heartbeat
        return PartitionState(**state)

    async def reset_cost_model_errors(self) -> bool:
        """False when the server has no cost model (no green contexts)."""
        return bool(await self._core.call("reset_cost_model_errors"))


class EngineView:
    def __init__(self, core: Any, info: dict[str, Any], tokenizer: Any) -> None:
        self._core = core
        self.info = info
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(
            vocab_size=int(info["vocab_size"]),
            eos_token_ids=tuple(info.get("eos_token_ids") or ()),
            max_position_embeddings=int(
                info.get("max_position_embeddings") or info["max_model_len"]
            ),
        )
        self.max_model_len = int(info["max_model_len"])
        self.max_prompt_tokens = int(info.get("max_prompt_tokens") or self.max_model_len)
        self.max_score_tokens = int(info.get("max_score_tokens") or self.max_model_len)
        self.partition = PartitionView(core)

    def stats(self) -> dict[str, Any]:
        return self._core.stats()

    def is_alive(self) -> bool:
        return self._core.is_alive()

    async def set_policy(self, name: str) -> None:
        """Raises ValueError for a policy the engine does not know."""
        await self._core.call("set_policy", name)
        self._core.note(policy=name)

    async def set_prefill_limits(
        self,
        prefill_token_budget: int,
        tbt_slo_ms: float | None,
        mixed_step_token_budget: int | None,
        chunk_fixed_share: float | None,
    ) -> None:
        """Raises ValueError for limits the engine refuses (a budget above the one it was
        sized for, a non-positive target or cap, a share outside (0, 1))."""
        await self._core.call(
            "set_prefill_limits",
            prefill_token_budget,
            tbt_slo_ms,
            mixed_step_token_budget,
            chunk_fixed_share,
        )
        self._core.note(
            stats={
                "prefill_token_budget": prefill_token_budget,
                "tbt_slo_ms": tbt_slo_ms,
                "mixed_step_token_budget": mixed_step_token_budget,
                "chunk_fixed_share": chunk_fixed_share,
            }
        )

    async def reset_prefix_cache(self) -> None:
        await self._core.call("reset_prefix_cache")

    async def step_trace(self, limit: int) -> list[dict[str, Any]]:
        """The engine's most recent `limit` steps (runtime.engine.STEP_TRACE_FIELDS); raises
        ValueError when the engine keeps none."""
        return await self._core.call("step_trace", limit)

    async def profile_steps(self, num_steps: int, timeout_s: float, trace: bool) -> dict[str, Any]:
        """The torch profiler over the engine's next `num_steps` steps: its summary (kernels by
        device time, steps by kind; runtime.diagnostics.profiling), the trace file's path when
        `trace`. Raises ValueError while another profile runs or when the engine cannot profile."""
        return await self._core.call(
            "profile_steps", num_steps, timeout_s, trace, timeout_s=timeout_s + 120.0
        )

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting, let running requests finish within `grace_s`, abort the rest; returns
        when the engine has sent every final output."""
        await self._core.call("shutdown", grace_s, timeout_s=grace_s + 60.0)
