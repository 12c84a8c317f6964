"""Device tensors of the paged KV pool, and how many blocks to make.

Layout per layer: k and v each [num_blocks, block_size, num_kv_heads, head_dim]. Token
position p of a sequence lives in block `block_ids[p // block_size]` at offset
`p % block_size`; its flat "slot" is `block_id * block_size + p % block_size` (what
attention backends index with `pool.k[layer].view(-1, num_kv_heads, head_dim)`).
"""

from __future__ import annotations

import torch

from runtime.config import CHUNK_MEMORY_SHARE, PREFILL_CHUNK_CHOICES, EngineConfig
from runtime.model.config import ModelConfig

GIB = 1 << 30
# Blocks the pool holds beyond the block manager's range: block `num_blocks` (the last) is
# the pad block that padded CUDA-graph decode rows read and write (never a live sequence's).
NUM_RESERVED_BLOCKS = 1
# CUDA only: bytes kept free for activations of one step, on top of the estimate below.
CUDA_SAFETY_BYTES = 512 << 20


def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of `block_size` tokens across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_layers * block_size * model_config.kv_size * elem


def chunk_temporaries_bytes(model_config: ModelConfig, chunk_tokens: int, elem_bytes: int) -> int:
    """Bytes a chunk of the MLP holds at its peak, about: the gate|up intermediate and its
    activation (3 x intermediate) and the output and residual rows (2 x hidden), per token."""
    mc = model_config
    return chunk_tokens * (3 * mc.intermediate_size + 2 * mc.hidden_size) * elem_bytes


def auto_prefill_chunk_tokens(
    model_config: ModelConfig, elem_bytes: int, shared_bytes: float
) -> int:
    """The chunk `prefill_chunk_tokens` = auto takes on CUDA, given the bytes the KV pool and
    the activations may share (`cuda_memory_budget_bytes`, less an explicitly sized pool): the
    largest of PREFILL_CHUNK_CHOICES within CHUNK_MEMORY_SHARE of them, else the smallest."""
    for chunk in PREFILL_CHUNK_CHOICES:
        if chunk_temporaries_bytes(model_config, chunk, elem_bytes) <= (
            CHUNK_MEMORY_SHARE * shared_bytes
        ):
            return chunk
    return PREFILL_CHUNK_CHOICES[-1]


def activation_reserve_bytes(
    config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype
) -> int:
    """Rough peak of one step's activations (CUDA sizing only).

    Tokens in flight per step T = prefill_token_budget (the scheduler's cap, a long
    scoring prompt running alone excepted); token-wise ops touch C = prefill_chunk_tokens rows
    at a time with hybrid prefill, else T. Estimate: T rows of hidden/qkv/residual buffers plus
    C rows of the MLP's gate|up intermediate, and fp32 logits for the sampled rows.
    The GPU runtime replaces this with a measured peak."""
    elem = torch.empty((), dtype=dtype).element_size()
    t = config.prefill_token_budget
    c = min(config.chunk_tokens(), t) if config.hybrid_prefill else t
    mc = model_config
    per_token = (4 * mc.hidden_size + mc.q_size + 2 * mc.kv_size) * elem
    mlp = c * 3 * mc.intermediate_size * elem
    logits = config.max_num_seqs * mc.vocab_size * 4 * 2
    return t * per_token + mlp + logits + CUDA_SAFETY_BYTES


def cuda_memory_budget_bytes(
    config: EngineConfig, device: torch.device, baseline_reserved: int = 0
) -> float:
    """Bytes the KV pool and the activation reserve may share on `device`: the
    `gpu_memory_utilization` share of the device minus what is in use (this process's weights
    and anything else on the GPU), capped by `max_gpu_memory_gb` minus what this engine holds:
    what this process's allocator holds beyond `baseline_reserved` (the amount it held before
    the engine started, e.g. another engine in the same process, which is not this one's).
    Memory this process's caching allocator keeps cached but unused is released first: it would
    otherwise count as used and shrink the pool for nothing."""
    torch.cuda.empty_cache()
    free_b, total_b = torch.cuda.mem_get_info(device)
    budget = total_b * config.gpu_memory_utilization - (total_b - free_b)
    if config.max_gpu_memory_gb is not None:
        # memory_reserved: what this process's caching allocator holds (weights + cache).
        held = torch.cuda.memory_reserved(device) - baseline_reserved
        budget = min(budget, config.max_gpu_memory_gb * GIB - held)
    return budget


def compute_num_blocks(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    activation_bytes: int | None = None,
    baseline_reserved: int = 0,
) -> int:
    """How many KV blocks to allocate. Call after the weights are on the device.
    baseline_reserved: see `cuda_memory_budget_bytes`.

    - `config.num_kv_blocks` wins when set.
    - CPU: `cpu_kv_cache_gb` worth of blocks.
    - CUDA: budget = total * gpu_memory_utilization - (bytes already used on the device,
      weights included) - activation reserve; with `max_gpu_memory_gb`, the budget is also
      capped by cap - memory this process already allocated - reserve.
    - `activation_bytes` (measured by `measure_activation_peak`) replaces the estimate.
    The count excludes the pool's reserved pad block (`KVPool` adds it).
    Raises RuntimeError when not even one block fits."""
    per_block = bytes_per_block(model_config, config.block_size, dtype)
    if config.num_kv_blocks is not None:
        n = config.num_kv_blocks
    elif device.type == "cuda":
        if activation_bytes is None:
            reserve = activation_reserve_bytes(config, model_config, dtype)
        else:
            reserve = activation_bytes + CUDA_SAFETY_BYTES
        budget = cuda_memory_budget_bytes(config, device, baseline_reserved)
        n = int((budget - reserve) // per_block)
        n -= NUM_RESERVED_BLOCKS
    else:
        n = int(config.cpu_kv_cache_gb * GIB // per_block)
    if n < 1:
        also = ""
        if config.max_score_tokens is not None and activation_bytes is not None:
            # The reserve covers the longest scoring prompt asked for: the usual culprit.
            also = (
                f"; the activation reserve is {activation_bytes / GIB:.2f} GiB, sized for "
                f"--max-score-tokens {config.max_score_tokens}: lower it"
            )
        raise RuntimeError(
            f"no room for the KV cache: one block needs {per_block / 2**20:.1f} MiB "
            f"(raise the memory limits or lower block_size / prefill_token_budget){also}"
        )
    return n


class KVPool:
    """Per-layer K and V block tensors on one device.

    `num_blocks` blocks are the block manager's (ids 0..num_blocks-1). With
    `num_reserved_blocks` > 0 (what `for_model`, the engine's path, asks for) the tensors hold
    that many more and `pad_block_id` (== num_blocks) is the pad block; else it is None."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_reserved_blocks: int = 0,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_reserved_blocks = num_reserved_blocks
        self.pad_block_id: int | None = num_blocks if num_reserved_blocks > 0 else None
        shape = (num_blocks + num_reserved_blocks, block_size, num_kv_heads, head_dim)
        # Zero-filled so that reading a not-yet-written slot (a masked pad) is never NaN.
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]

    @classmethod
    def for_model(
        cls,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_reserved_blocks: int = NUM_RESERVED_BLOCKS,
    ) -> KVPool:
        """The engine's pool: `num_blocks` for the block manager plus the reserved pad block."""
        return cls(
            model_config.num_layers,
            num_blocks,
            block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype,
            device,
            num_reserved_blocks,
        )

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def num_total_blocks(self) -> int:
        """Blocks in the tensors: the manager's plus the reserved pad block."""
        return self.num_blocks + self.num_reserved_blocks

    def flat_k(self, layer_idx: int) -> torch.Tensor:
        """[num_blocks * block_size, num_kv_heads, head_dim] view (slot-indexed)."""
        return self.k[layer_idx].view(-1, self.num_kv_heads, self.head_dim)

    def flat_v(self, layer_idx: int) -> torch.Tensor:
        return self.v[layer_idx].view(-1, self.num_kv_heads, self.head_dim)
