"""Fused decode: the decoder's forward for 1..64 sequences on the Triton kernels of
`runtime/model/decode_kernels.py`, 7 launches per layer instead of ~11-14 (why: see that
module).

`FusedDecodeStep` is a drop-in for one captured decode graph: `plan(batch)` fills fixed
device buffers (block table, sequence lengths, KV slots) with two host-to-device copies and no
kernel planning; `forward(input_ids, positions)` runs the model on those buffers, so a CUDA
graph captured around it replays for any batch of the same padded size. The weights are the
model's own tensors (nothing is copied).

Supported: Llama-family models without q/k norms or an o_proj bias, KV cache in the model's
half dtype, head_dim a power of two. `unsupported_reason(cfg)` says why not otherwise; the
caller then keeps the unfused decode (FlashInfer + cuBLAS) and says so once.
"""

from __future__ import annotations

import torch

from runtime.attention.base import ForwardBatch
from runtime.model.config import ModelConfig
from runtime.model.llama import LlamaForCausalLM


def unsupported_reason(cfg: ModelConfig, kv_dtype: torch.dtype) -> str:
    """ "" when `FusedDecodeStep` can run this model, else why not."""
    if cfg.qk_norm:
        return "the model has q/k norms (Qwen3), which the fused qkv kernel does not apply"
    if cfg.o_bias:
        return "the model has an o_proj bias"
    if kv_dtype not in (torch.float16, torch.bfloat16):
        return f"the KV cache is {kv_dtype}, not float16/bfloat16"
    if cfg.head_dim & (cfg.head_dim - 1) or cfg.head_dim < 16:
        return f"head_dim {cfg.head_dim} is not a power of two >= 16"
    if cfg.num_q_heads % cfg.num_kv_heads:
        return "num_q_heads is not a multiple of num_kv_heads"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising at import
        return f"triton cannot be imported ({type(exc).__name__}: {exc})"
    return ""


class FusedDecodeStep:
    """One padded decode batch size's forward on the fused kernels (see the module doc)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        batch_size: int,
        max_blocks_per_seq: int,
        *,
        num_sms: int | None = None,
    ) -> None:
        """k_caches/v_caches: per layer [num_blocks, block_size, Hkv, D] (runtime/kv/kv_pool.py)."""
        from runtime.model import decode_kernels as dk

        if not 1 <= batch_size <= dk.MAX_ROWS:
            raise ValueError(f"fused decode takes 1..{dk.MAX_ROWS} rows, got {batch_size}")
        cfg = model.cfg
        why = unsupported_reason(cfg, k_caches[0].dtype)
        if why:
            raise ValueError(f"fused decode cannot run this model: {why}")
        self._dk = dk
        self.model = model
        self.cfg = cfg
        self.batch_size = batch_size
        self.block_size = int(k_caches[0].shape[1])
        dev = k_caches[0].device
        # Flat [num_slots, Hkv, D] views of each layer's pool (slot = block * block_size + i).
        self.k_flat = [k.view(-1, cfg.num_kv_heads, cfg.head_dim) for k in k_caches]
        self.v_flat = [v.view(-1, cfg.num_kv_heads, cfg.head_dim) for v in v_caches]
        # Fixed buffers a captured graph reads on every replay; `plan` refills them.
        self.block_table = torch.zeros(
            batch_size, max_blocks_per_seq, dtype=torch.int32, device=dev
        )
        # Rows: tokens to attend, this step's KV slot, tokens per attention split.
        self.lens_slots = torch.ones(3, batch_size, dtype=torch.int64, device=dev)
        # Host staging (pinned on CUDA), filled through numpy views: a numpy store costs well
        # under a microsecond where a torch indexing op costs several (batch 1 is host-bound).
        self._host_table = torch.zeros(batch_size, max_blocks_per_seq, dtype=torch.int32)
        self._host_lens_slots = torch.ones(3, batch_size, dtype=torch.int64)
        if dev.type == "cuda":
            self._host_table = self._host_table.pin_memory()
            self._host_lens_slots = self._host_lens_slots.pin_memory()
            num_sms = num_sms or torch.cuda.get_device_properties(dev).multi_processor_count
        self._np_table = self._host_table.numpy()
        self._np_lens_slots = self._host_lens_slots.numpy()
        self.num_sms = num_sms or 132
        self.num_splits = dk.attention_splits(batch_size, cfg.num_kv_heads, self.num_sms)
        # The attention's per-(row, KV head) split counters: the last split to finish merges
        # the partials, then zeroes its counter, so one zeroed buffer serves every layer and
        # every replay (an attention launch touches it only once the previous one has completed).
        self.attn_counters = torch.zeros(
            batch_size, cfg.num_kv_heads, dtype=torch.int32, device=dev
        )
        self.sm_scale = cfg.head_dim**-0.5

    def plan(self, batch: ForwardBatch) -> None:
        """Fill the block table, lengths and slots for `batch` (exactly batch_size decode
        rows, pad rows included), on the current stream, without a host sync.
        Hazard: the pinned staging buffers are rewritten here, so the previous step's copy
        must have finished (every decode step ends in a host sync)."""
        seqs = batch.seqs
        if len(seqs) != self.batch_size or not batch.is_decode:
            raise ValueError(f"a fused step for {self.batch_size} decode rows got {len(seqs)}")
        bs_tok = self.block_size
        table, lens_slots = self._np_table, self._np_lens_slots
        width = 1
        for i, s in enumerate(seqs):
            num_tokens = s.num_context_tokens + 1
            n_blocks = (num_tokens + bs_tok - 1) // bs_tok
            if n_blocks > table.shape[1]:
                raise ValueError(f"sequence of {num_tokens} tokens exceeds the block table")
            table[i, :n_blocks] = s.block_ids[:n_blocks]
            width = max(width, n_blocks)
            pos = s.num_context_tokens
            lens_slots[0, i] = num_tokens
            lens_slots[1, i] = s.block_ids[pos // bs_tok] * bs_tok + pos % bs_tok
        # Each row's attention splits by its own context (a long row among short ones gets more).
        self._dk.split_chunk_tokens(
            lens_slots[0], self.cfg.num_kv_heads, self.num_splits, self.num_sms, out=lens_slots[2]
        )
        # Only the used columns travel (one 2-D copy); stale columns beyond are never read.
        self.block_table[:, :width].copy_(self._host_table[:, :width], non_blocking=True)
        self.lens_slots.copy_(self._host_lens_slots, non_blocking=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [batch_size] int64 -> final hidden states [batch_size, H]
        (after the final norm, like `LlamaForCausalLM.forward`)."""
        dk, cfg, model = self._dk, self.cfg, self.model
        seq_lens, slots, chunk_tokens = self.lens_slots[0], self.lens_slots[1], self.lens_slots[2]
        cos_sin = model.rotary.cos_sin_cache
        residual = model.embed(input_ids)  # [M, H]: the residual stream starts as the embedding
        parts: torch.Tensor | None = None  # the last projection's split-K partials [S, M, H]
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = dk.add_rmsnorm(parts, residual, layer.input_layernorm.weight, cfg.rms_norm_eps)
            q = dk.qkv_rope_write(
                x,
                attn.qkv_proj.weight,
                attn.qkv_proj.bias,
                positions,
                cos_sin,
                self.k_flat[i],
                self.v_flat[i],
                slots,
                cfg.num_q_heads,
            )
            o = dk.decode_attention(
                q,
                self.k_flat[i],
                self.v_flat[i],
                self.block_table,
                seq_lens,
                self.block_size,
                self.sm_scale,
                self.num_splits,
                chunk_tokens=chunk_tokens,
                counters=self.attn_counters,
            )
            parts = dk.gemv_splitk(o.view(o.shape[0], -1), attn.o_proj.weight, kind="o")
            x = dk.add_rmsnorm(
                parts, residual, layer.post_attention_layernorm.weight, cfg.rms_norm_eps
            )
            g = dk.gate_up_silu(x, mlp.gate_up_proj.weight)
            parts = dk.gemv_splitk(g, mlp.down_proj.weight, kind="down")
        return dk.add_rmsnorm(parts, residual, model.norm.weight, cfg.rms_norm_eps)
