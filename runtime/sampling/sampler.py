"""Batched token sampling on the logits' device: penalties, logit bias, greedy, temperature,
top-k, top-p, min-p, seeds, and logprobs with top alternatives. Nothing here waits for the
device: results stay device tensors until the runner copies them to the host.

Sampling uses the exponential-race trick: argmax(probs / E) with E ~ Exp(1) per vocabulary
entry draws from `probs`. The noise E of a request with a seed comes from its own
`torch.Generator`, so its tokens do not depend on its batch mates; unseeded rows share
the global generator.

Penalties (presence, frequency, repetition) need what each request generated so far, which
the host learns one step late under overlapped scheduling: `PenaltyState` keeps per-request
token counts on the device, initialised from the prompt (and any output kept across a
preemption) at the final prefill chunk and bumped by every sampled token, in stream order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.model.ops import h2d
from runtime.request import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A per-request generator (lives on the logits' device)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass(slots=True)
class SampleResult:
    """Device tensors; `top_*` only when some row asked for alternatives."""

    token_ids: torch.Tensor  # [N] int64
    chosen_logprobs: torch.Tensor | None = None  # [N] float32 (rows asking for logprobs)
    top_ids: torch.Tensor | None = None  # [N, k_max] int64
    top_logprobs: torch.Tensor | None = None  # [N, k_max] float32


def has_penalties(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


class PenaltyState:
    """Per-request output-token counts and prompt-token masks on the device, one row per
    request with penalties ([rows, vocab] int32 and bool; grown by doubling).

    Rows are recycled only after `free(request_id)`, which the engine calls once no launched
    step uses the request any more (its lease was freed), so an in-flight step never bumps
    counts in a row another request already owns."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self._row_of: dict[str, int] = {}
        self._free: list[int] = []

    def row(self, request_id: str) -> int:
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self._free.pop()
            self._row_of[request_id] = row
        return row

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab, dtype=torch.int32, device=self.device)
        mask = torch.zeros(new, self.vocab, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        mask[:old] = self.prompt_mask
        self.counts, self.prompt_mask = counts, mask
        self._free.extend(range(new - 1, old - 1, -1))

    def free(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def init_rows(
        self, rows: list[int], prompts: list[list[int]], outputs: list[list[int]]
    ) -> None:
        """Reset rows to their requests' prompt mask and output counts (host-known ids)."""
        dev = self.device
        idx = _dev(rows, dev)
        self.counts.index_fill_(0, idx, 0)
        self.prompt_mask.index_fill_(0, idx, False)
        p_rows = [r for r, ids in zip(rows, prompts, strict=True) for _ in ids]
        p_ids = [t for ids in prompts for t in ids]
        if p_ids:
            self.prompt_mask[_dev(p_rows, dev), _dev(p_ids, dev)] = True
        o_rows = [r for r, ids in zip(rows, outputs, strict=True) for _ in ids]
        o_ids = [t for ids in outputs for t in ids]
        if o_ids:
            ones = torch.ones(len(o_ids), dtype=torch.int32, device=dev)
            self.counts.index_put_((_dev(o_rows, dev), _dev(o_ids, dev)), ones, accumulate=True)


def _dev(values: list, device: torch.device) -> torch.Tensor:
    return h2d(values, torch.int64, device)


def _inverse_cdf(
    x: torch.Tensor, generators: Sequence[torch.Generator | None], greedy: list[bool]
) -> torch.Tensor:
    """Sample each row of logits `x` [N, V] by inverting its CDF with one uniform draw.

    The CPU path: exact like the exponential race, but one random number per row instead of
    V (CPU `exponential_` over a 49k vocabulary costs ~0.7 ms a row; this ~0.04 ms)."""
    n, vocab = x.shape
    cdf = x.softmax(dim=-1).cumsum_(dim=-1)  # [N, V]
    u = torch.rand(n, 1)
    for i, g in enumerate(generators):
        if g is not None and not greedy[i]:
            u[i] = torch.rand(1, generator=g)
    # right=True: the first index whose cumulative mass exceeds u, so a token of zero mass
    # (masked) is never picked; u is scaled by the row's total against rounding in the sum.
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
    # u * total may round up to the total itself: the clamp then lands on the last token,
    # which may be masked; take the row's most likely token instead (probability ~1e-7).
    masked = x.gather(1, idx) == float("-inf")
    idx = torch.where(masked, x.argmax(dim=-1, keepdim=True), idx)
    return idx.squeeze(1)


def _dev_f(values: list[float], device: torch.device) -> torch.Tensor:
    return h2d(values, torch.float32, device)


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        penalty_rows: Sequence[int | None] | None = None,
        penalties: PenaltyState | None = None,
        banned: Sequence[tuple[int, Sequence[int]]] = (),
        allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SampleResult:
        """logits: [N, vocab] float32, one row per request; `params`, `generators` and
        `penalty_rows` (the request's PenaltyState row, None without penalties) per row.
        Sampled tokens bump their rows' counts in `penalties`. `banned`: (row, token ids) that
        row may not sample (`min_tokens`: its stop tokens). `allowed`: (rows [R] int64, mask
        [R, W] bool, W <= vocab) on the device: those rows sample only where their mask is
        true (a grammar; ids from W on are not allowed). Logprobs stay the model's."""
        n, vocab = logits.shape
        dev = logits.device
        want_lp = [p.logprobs for p in params]
        raw = logits  # logprobs are of the model's distribution (before any processing)
        x = logits
        pen = [i for i, r in enumerate(penalty_rows or ()) if r is not None]
        if pen:
            assert penalties is not None and penalty_rows is not None
            x = self._apply_penalties(x, pen, [penalty_rows[i] for i in pen], params, penalties)
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
        if bias:
            if x is logits:
                x = x.clone()
            rows = _dev([i for i, _, _ in bias], dev)
            toks = _dev([t for _, t, _ in bias], dev)
            x.index_put_((rows, toks), _dev_f([b for _, _, b in bias], dev), accumulate=True)
        ban = [(i, t) for i, ids in banned for t in ids if 0 <= t < vocab]
        if ban:
            if x is logits:
                x = x.clone()
            rows = _dev([i for i, _ in ban], dev)
            toks = _dev([t for _, t in ban], dev)
            x.index_put_((rows, toks), torch.tensor(float("-inf"), device=dev))
        if allowed is not None:
            if x is logits:
                x = x.clone()
            rows, mask = allowed
            sub = x.index_select(0, rows)  # [R, vocab]
            width = min(mask.shape[1], vocab)
            sub[:, :width].masked_fill_(~mask[:, :width], float("-inf"))
            sub[:, width:] = float("-inf")
            x.index_copy_(0, rows, sub)

        greedy = [p.is_greedy for p in params]
        if all(greedy):
            tokens = x.argmax(dim=-1)
        else:
            tokens = self._sample_random(x, params, generators, greedy)
        if pen:
            rows_t = _dev([penalty_rows[i] for i in pen], dev)  # type: ignore[index]
            sel = _dev(pen, dev)
            one = torch.ones(len(pen), dtype=torch.int32, device=dev)
            penalties.counts.index_put_((rows_t, tokens.index_select(0, sel)), one, accumulate=True)  # type: ignore[union-attr]

        result = SampleResult(tokens)
        if any(k is not None for k in want_lp):
            logp = raw.log_softmax(dim=-1)
            result.chosen_logprobs = logp.gather(1, tokens[:, None]).squeeze(1)
            k_max = min(max(k or 0 for k in want_lp), vocab)
            if k_max > 0:
                result.top_logprobs, result.top_ids = logp.topk(k_max, dim=-1)
        return result

    @staticmethod
    def _apply_penalties(
        logits: torch.Tensor,
        rows: list[int],
        state_rows: list[int | None],
        params: Sequence[SamplingParams],
        state: PenaltyState,
    ) -> torch.Tensor:
        dev = logits.device
        x = logits.clone()
        sel = _dev(rows, dev)
        srows = _dev([r for r in state_rows if r is not None], dev)
        counts = state.counts.index_select(0, srows)  # [n, V] int32
        seen_out = counts > 0
        seen = seen_out | state.prompt_mask.index_select(0, srows)
        sub = x.index_select(0, sel)
        rep = _dev_f([params[i].repetition_penalty for i in rows], dev)[:, None]
        pres = _dev_f([params[i].presence_penalty for i in rows], dev)[:, None]
        freq = _dev_f([params[i].frequency_penalty for i in rows], dev)[:, None]
        # Repetition penalty (CTRL / HF semantics) over prompt and output tokens.
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        # Presence and frequency penalties (OpenAI semantics) over output tokens only.
        sub = sub - pres * seen_out - freq * counts
        x.index_copy_(0, sel, sub)
        return x

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
            x = logits / _dev_f(temp_list, dev)[:, None]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        if any(m > 0.0 for m in min_p):
            # Drop tokens whose probability is below min_p x the most likely one's:
            # log p - log p_max < log min_p (log space: no softmax needed).
            floor = torch.log(_dev_f([max(m, 1e-30) for m in min_p], dev))[:, None]
            use = _dev_f([1.0 if m > 0.0 else 0.0 for m in min_p], dev)[:, None] > 0
            drop = (x - x.max(dim=-1, keepdim=True).values < floor) & use
            x = x.masked_fill(drop, float("-inf"))
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_x, order = x.sort(dim=-1, descending=True)  # [N, V]
            if any(k < vocab for k in top_k):
                k_t = _dev(top_k, dev)
                sorted_x.masked_fill_(
                    torch.arange(vocab, device=dev)[None, :] >= k_t[:, None], float("-inf")
                )
            if any(p < 1.0 for p in top_p):
                p_t = _dev_f([max(p, 1e-6) for p in top_p], dev)
                probs_sorted = sorted_x.softmax(dim=-1)
                # Drop a token when the mass strictly before it already reaches top_p; the
                # first token always stays (its "before" is 0 and top_p is clamped above 0).
                before = probs_sorted.cumsum(dim=-1) - probs_sorted
                sorted_x.masked_fill_(before >= p_t[:, None], float("-inf"))
            x = torch.empty_like(x).scatter_(1, order, sorted_x)
        if dev.type == "cpu":
            sampled = _inverse_cdf(x, generators, greedy)
        else:
            # The race in log space: argmax(p / E) = argmax(log p - log E) = argmax(x - log E),
            # since log p and x differ by a per-row constant; no softmax and no host sync.
            noise = torch.empty_like(x).exponential_()
            for i, g in enumerate(generators):
                if g is not None and not greedy[i]:
                    noise[i] = torch.empty(vocab, dtype=x.dtype, device=dev).exponential_(
                        generator=g
                    )
            sampled = (x - noise.log()).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(_dev(greedy, dev).bool(), x.argmax(dim=-1), sampled)
        return sampled
