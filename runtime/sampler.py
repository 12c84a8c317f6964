"""Batched token sampling on the logits' device: greedy, temperature, top-k, top-p, seeds,
and logprobs with top alternatives.

Sampling uses the exponential-race trick: argmax(probs / E) with E ~ Exp(1) per vocabulary
entry draws from `probs`. The noise E of a request with a seed comes from its own
`torch.Generator`, so its tokens do not depend on its batch mates; unseeded rows share
the global generator. The only host transfer is the final `.tolist()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.request import SamplingParams, TokenLogprob


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A per-request generator (lives on the logits' device)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None when the request did not ask


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> SamplerOutput:
        """logits: [N, vocab] float32, one row per request; `params`/`generators` per row."""
        n, vocab = logits.shape
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_random(logits, params, generators, greedy)

        want_lp = [p.logprobs for p in params]
        logprob_rows: list[TokenLogprob | None] = [None] * n
        if any(k is not None for k in want_lp):
            # Logprobs of the model's distribution (before temperature / top-k / top-p).
            logp = logits.log_softmax(dim=-1)
            chosen = logp.gather(1, tokens[:, None]).squeeze(1)
            k_max = min(max(k or 0 for k in want_lp), vocab)
            top_vals = top_ids = None
            if k_max > 0:
                top_vals, top_ids = logp.topk(k_max, dim=-1)
            tokens_l = tokens.tolist()
            chosen_l = chosen.tolist()
            tv = top_vals.tolist() if top_vals is not None else None
            ti = top_ids.tolist() if top_ids is not None else None
            for i, k in enumerate(want_lp):
                if k is None:
                    continue
                top = list(zip(ti[i][:k], tv[i][:k], strict=True)) if (k and ti and tv) else []
                logprob_rows[i] = TokenLogprob(tokens_l[i], chosen_l[i], top)
            return SamplerOutput(tokens_l, logprob_rows)
        return SamplerOutput(tokens.tolist(), logprob_rows)

    @staticmethod
    def _sample_random(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        greedy: list[bool],
    ) -> torch.Tensor:
        n, vocab = logits.shape
        dev = logits.device
        temp_list = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        x = logits
        if any(t != 1.0 for t in temp_list):
            temps = torch.tensor(temp_list, dtype=logits.dtype).to(dev, non_blocking=True)
            x = logits / temps[:, None]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_x, order = x.sort(dim=-1, descending=True)  # [N, V]
            if any(k < vocab for k in top_k):
                k_t = torch.tensor(top_k, device=dev)
                sorted_x.masked_fill_(
                    torch.arange(vocab, device=dev)[None, :] >= k_t[:, None], float("-inf")
                )
            if any(p < 1.0 for p in top_p):
                p_t = torch.tensor([max(p, 1e-6) for p in top_p], dtype=logits.dtype).to(
                    dev, non_blocking=True
                )
                probs_sorted = sorted_x.softmax(dim=-1)
                # Drop a token when the mass strictly before it already reaches top_p; the
                # first token always stays (its "before" is 0 and top_p is clamped above 0).
                before = probs_sorted.cumsum(dim=-1) - probs_sorted
                sorted_x.masked_fill_(before >= p_t[:, None], float("-inf"))
            x = torch.empty_like(x).scatter_(1, order, sorted_x)
        # The race in log space: argmax(p / E) = argmax(log p - log E) = argmax(x - log E),
        # since log p and x differ by a per-row constant; no softmax needed.
        noise = torch.empty_like(x).exponential_()
        for i, g in enumerate(generators):
            if g is not None and not greedy[i]:
                noise[i] = torch.empty(vocab, dtype=x.dtype, device=dev).exponential_(generator=g)
        sampled = (x - noise.log()).argmax(dim=-1)
        if any(greedy):
            greedy_t = torch.tensor(greedy, device=dev)
            sampled = torch.where(greedy_t, logits.argmax(dim=-1), sampled)
        return sampled
