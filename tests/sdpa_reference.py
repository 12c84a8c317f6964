"""Test-only attention backend shared by the model tests: one sequence, no KV cache, causal
SDPA over the call's q/k/v (GQA by repeating kv heads). Positions are assumed to be one
contiguous run."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CausalSDPA:
    name = "test-sdpa"

    def plan(self, batch: object) -> None:
        pass

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return o.transpose(0, 1)
