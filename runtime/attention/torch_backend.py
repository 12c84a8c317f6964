"""Reference attention backend over the paged KV pool: torch SDPA, CPU and CUDA.

plan(): builds, on the host and then copied to the device once per step,
  - the slot mapping of this step's new tokens (pool slot, or -1 for a discarded suffix
    token at a position >= num_kept_tokens), reduced to (rows to write, slots to write);
  - per sequence, the pool slots of its cached context [0, num_context_tokens);
  - for a decode batch, a padded [B, L] gather index + key mask (L = longest context + 1).
forward(): writes kept k/v into the pool, then attends. Prefill sequences run one SDPA call
each over [context from the pool] + [this step's k/v] with a causal mask offset by the
context length; a decode batch runs one padded SDPA call. GQA via `enable_gqa`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.attention.base import ForwardBatch, Rope, fuse_rope_for, load_rope_kv_write
from runtime.kv.kv_pool import KVPool
from runtime.model import ops


@dataclass(slots=True)
class _SeqPlan:
    query_start: int
    num_query_tokens: int
    context_slots: torch.Tensor | None  # [num_context_tokens] int64 on device; None if 0
    mask: torch.Tensor | None  # [q, context + q] bool (True = attend); None = plain causal


@dataclass(slots=True)
class _DecodePlan:
    gather_slots: torch.Tensor  # [B, L] int64: slots of context + the new token, padded
    key_mask: torch.Tensor  # [B, 1, 1, L] bool: True for real keys


class TorchAttentionBackend:
    """SDPA over the paged pool. One instance per stream (plans are per instance)."""

    name = "torch"

    def __init__(self, kv_pool: KVPool, fuse_rope_kv_write: bool = False) -> None:
        """fuse_rope_kv_write: rotate q/k and write the pool in one Triton launch
        (runtime/attention/rope_kv_write.py; interpreted without CUDA: for tests)."""
        self.pool = kv_pool
        self._rope_kv_write = load_rope_kv_write(
            fuse_rope_kv_write, kv_pool.device, kv_pool.head_dim
        )
        self.fuses_rope = self._rope_kv_write is not None
        self.writes_out = False  # it computes the output, then copies it into out=
        self._token_slots: torch.Tensor | None = None  # [T] slot per row, -1: not written
        self._write_rows: torch.Tensor | None = None  # [W] rows of this step's k/v to keep
        self._write_slots: torch.Tensor | None = None  # [W] their pool slots
        self._all_rows_written = False
        self._num_tokens = 0
        self._seqs: list[_SeqPlan] = []
        self._decode: _DecodePlan | None = None
        # One sequence without context: how many of its rows are written, in order; else None.
        self._num_rows_written: int | None = None

    # ---- planning ------------------------------------------------------------------------
    def plan(self, batch: ForwardBatch) -> None:
        bs = self.pool.block_size
        dev = self.pool.device
        slot_mapping = torch.full((batch.num_tokens,), -1, dtype=torch.int64)
        seq_plans: list[_SeqPlan] = []
        for s in batch.seqs:
            ctx, n, kept = s.num_context_tokens, s.num_query_tokens, s.num_kept_tokens
            if kept < ctx:
                raise ValueError(f"num_kept_tokens {kept} < num_context_tokens {ctx}")
            if len(s.block_ids) * bs < kept:
                raise ValueError(f"{len(s.block_ids)} blocks cannot hold {kept} kept tokens")
            table = ops.host_tensor(s.block_ids, torch.int64)
            num_written = max(0, min(ctx + n, kept) - ctx)
            if num_written:
                pos = torch.arange(ctx, ctx + num_written)
                slot_mapping[s.query_start : s.query_start + num_written] = (
                    table[pos // bs] * bs + pos % bs
                )
            ctx_slots = None
            mask = None
            if ctx:
                pos = torch.arange(ctx)
                ctx_slots = (table[pos // bs] * bs + pos % bs).to(dev, non_blocking=True)
                if n > 1:
                    # Query i sits at position ctx + i and sees keys 0 .. ctx + i.
                    mask = torch.arange(ctx + n)[None, :] <= (ctx + torch.arange(n))[:, None]
                    mask = mask.to(dev, non_blocking=True)
            seq_plans.append(_SeqPlan(s.query_start, n, ctx_slots, mask))

        rows = torch.nonzero(slot_mapping >= 0).flatten()
        self._all_rows_written = int(rows.numel()) == batch.num_tokens
        self._write_rows = rows.to(dev, non_blocking=True)
        self._write_slots = slot_mapping[rows].to(dev, non_blocking=True)
        fuse = self.fuses_rope and fuse_rope_for(batch.num_tokens)
        self._token_slots = slot_mapping.to(dev, non_blocking=True) if fuse else None
        self._seqs = seq_plans
        self._num_tokens = batch.num_tokens
        self._decode = self._plan_decode(batch) if batch.is_decode else None
        # One prefill sequence: its written rows are its first ones, in order.
        one = len(batch.seqs) == 1 and not batch.is_decode
        self._num_rows_written = int(rows.numel()) if one else None

    def _plan_decode(self, batch: ForwardBatch) -> _DecodePlan | None:
        """Padded gather over context + the token written this step (all from the pool)."""
        bs = self.pool.block_size
        lengths = [s.num_context_tokens + 1 for s in batch.seqs]
        if any(s.num_kept_tokens < n for s, n in zip(batch.seqs, lengths, strict=True)):
            return None  # a decode token that is not kept: use the per-sequence path
        max_len = max(lengths)
        gather = torch.zeros((len(lengths), max_len), dtype=torch.int64)
        key_mask = torch.zeros((len(lengths), max_len), dtype=torch.bool)
        for i, (s, n) in enumerate(zip(batch.seqs, lengths, strict=True)):
            pos = torch.arange(n)
            table = ops.host_tensor(s.block_ids, torch.int64)
            gather[i, :n] = table[pos // bs] * bs + pos % bs
            key_mask[i, :n] = True
        dev = self.pool.device
        return _DecodePlan(
            gather.to(dev, non_blocking=True),
            key_mask[:, None, None, :].to(dev, non_blocking=True),
        )

    # ---- forward -------------------------------------------------------------------------
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: Rope | None = None,
        out: torch.Tensor | None = None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D] (copied into `out` when given)."""
        assert self._write_rows is not None and self._write_slots is not None, "plan() first"
        k_pool = self.pool.flat_k(layer_idx)  # [slots, Hkv, D]
        v_pool = self.pool.flat_v(layer_idx)
        if kv_written:  # rotated and written by the caller (the prefill graphs)
            pass
        elif rope is not None and self._token_slots is not None:
            q, k = self._rope_kv_write(q, k, v, *rope, self._token_slots, k_pool, v_pool)
        else:
            if rope is not None:
                q, k = ops.apply_rope(q, k, *rope)
            self._write(k, v, k_pool, v_pool)
        o = self._attend(q, k, v, k_pool, v_pool)
        return o if out is None else out.copy_(o)

    def row_slots(self) -> torch.Tensor:
        assert self._write_rows is not None and self._write_slots is not None, "plan() first"
        if self._token_slots is not None:
            return self._token_slots
        out = torch.full((self._num_tokens,), -1, dtype=torch.int64, device=self.pool.device)
        return out.index_copy_(0, self._write_rows, self._write_slots)

    # ---- row streaming (a long prompt's hybrid prefill: DecoderLayer.forward_rows) -------
    def attends_rows(self) -> bool:
        return self._num_rows_written is not None

    def num_context_rows(self) -> int:
        assert self._num_rows_written is not None, "attends_rows() first"
        slots = self._seqs[0].context_slots
        return 0 if slots is None else int(slots.numel())

    def read_context(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self._seqs[0].context_slots
        assert slots is not None
        torch.index_select(self.pool.flat_k(layer_idx), 0, slots, out=k)  # no [ctx, ...] temp
        torch.index_select(self.pool.flat_v(layer_idx), 0, slots, out=v)

    def write_rows(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        assert self._num_rows_written is not None and self._write_slots is not None
        end = min(start + k.shape[0], self._num_rows_written)
        if end <= start:
            return
        slots = self._write_slots[start:end]  # one sequence from row 0: slot i is row i's
        k_pool, v_pool = self.pool.flat_k(layer_idx), self.pool.flat_v(layer_idx)
        k_pool.index_copy_(0, slots, k[: end - start].to(k_pool.dtype))
        v_pool.index_copy_(0, slots, v[: end - start].to(v_pool.dtype))

    def attend_rows(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        n, total = q.shape[0], k.shape[0]
        # Query i sits at position total - n + i and sees keys 0 .. total - n + i.
        mask = None
        if n > 1:
            pos = torch.arange(total - n, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            enable_gqa=True,
        )
        return o.transpose(0, 1)

    def _write(
        self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> None:
        assert self._write_rows is not None and self._write_slots is not None
        if self._all_rows_written:
            k_pool.index_copy_(0, self._write_slots, k.to(k_pool.dtype))
            v_pool.index_copy_(0, self._write_slots, v.to(v_pool.dtype))
        elif self._write_rows.numel():
            k_pool.index_copy_(0, self._write_slots, k.index_select(0, self._write_rows))
            v_pool.index_copy_(0, self._write_slots, v.index_select(0, self._write_rows))

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        if self._decode is not None:
            d = self._decode
            keys = k_pool[d.gather_slots].transpose(1, 2)  # [B, Hkv, L, D]
            values = v_pool[d.gather_slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=d.key_mask, enable_gqa=True
            )  # [B, Hq, 1, D]
            return out.squeeze(2)

        out = torch.empty_like(q)
        for s in self._seqs:
            lo, hi = s.query_start, s.query_start + s.num_query_tokens
            keys, values = k[lo:hi], v[lo:hi]  # [n, Hkv, D]
            if s.context_slots is not None:
                keys = torch.cat([k_pool[s.context_slots], keys], dim=0)
                values = torch.cat([v_pool[s.context_slots], values], dim=0)
            qs = q[lo:hi].transpose(0, 1)  # [Hq, n, D]
            o = F.scaled_dot_product_attention(
                qs,
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=s.mask,
                # With context and one query, the query sees everything: no mask needed.
                is_causal=s.context_slots is None and s.num_query_tokens > 1,
                enable_gqa=True,
            )
            out[lo:hi] = o.transpose(0, 1)
        return out
