"""Engine-level diagnostic: how many torch operations one cold scoring prefill dispatches, per
hybrid-prefill chunk size (`--prefill-chunk-tokens`).

On CUDA nearly every dispatched operation is a kernel launch, and a long prefill that launches
more kernels than the device's launch queue holds keeps the engine thread inside its launch
until near the step's end (docs/scheduling.md, "A long launch holds the engine thread"). This
counts them on the CPU with `TorchDispatchMode` (views and metadata included) for one scoring
request of `--tokens` new tokens, after a first request has warmed the engine. The CPU path
fuses less than CUDA's (its norms and RoPE are several operations each), so compare chunk
sizes with it, not devices. The count scales with the layers: report it per layer.

    python -m bench.op_count --tokens 10188 --chunks 2048,4096,8192,16384
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.request import Request, RequestKind


class _Count(TorchDispatchMode):
    """Counts every aten operation dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.num_ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.num_ops += 1
        return func(*args, **(kwargs or {}))


def count(model: str, num_tokens: int, chunk_tokens: int, block_size: int = 16) -> dict[str, Any]:
    """Operations dispatched by one cold scoring step of `num_tokens` at `chunk_tokens`."""
    config = EngineConfig(
        model=model,
        block_size=block_size,
        num_kv_blocks=2 * num_tokens // block_size + 64,
        max_model_len=num_tokens + 64,
        prefill_chunk_tokens=chunk_tokens,
        prefill_token_budget=num_tokens + 64,
        overlap_scheduling=False,  # one step collected at a time: the count is one step's
    )
    engine = Engine(config, lambda outputs: None)
    rng = random.Random(0)
    ids = [rng.randrange(100, 4000) for _ in range(num_tokens)]
    # A first request of other tokens warms the engine (first-use allocations, caches).
    engine.scheduler.add(Request("warm", RequestKind.SCORE, ids[::-1], label_token_ids=[5, 6]))
    engine._step()
    engine.scheduler.add(Request("cold", RequestKind.SCORE, ids, label_token_ids=[5, 6]))
    with _Count() as counter:
        engine._step()
    num_layers = engine.runner.model_config.num_layers
    return {
        "chunk_tokens": chunk_tokens,
        "num_ops": counter.num_ops,
        "num_layers": num_layers,
        "ops_per_layer": round(counter.num_ops / num_layers, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--tokens", type=int, default=10188, help="new tokens of the cold prompt")
    p.add_argument("--chunks", default="2048,4096,8192,16384", help="chunk sizes to count")
    args = p.parse_args()
    rows = [count(args.model, args.tokens, int(c)) for c in args.chunks.split(",")]
    print(json.dumps({"model": args.model, "num_tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
