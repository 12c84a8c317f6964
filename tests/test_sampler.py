"""Sampler: greedy, top-k / top-p / min-p support, per-request seeds independent of batch mates,
logprobs, penalties (presence, frequency, repetition) on device state, logit bias."""

from __future__ import annotations

import pytest
import torch

from runtime.request import SamplingParams
from runtime.sampling.sampler import PenaltyState, Sampler, make_generator

V = 50


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits(4)
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_seeded_rows_repeat_and_ignore_batch_mates() -> None:
    s = Sampler()
    logits = _logits(3)
    p = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for other_seed in (1, 2):
        gens = [make_generator(7, "cpu"), make_generator(other_seed, "cpu"), None]
        toks = []
        for _ in range(20):  # 20 successive draws with the same generators
            toks.append(
                s.sample(
                    logits, [p, SamplingParams(seed=other_seed), SamplingParams()], gens
                ).token_ids.tolist()
            )
        runs.append(toks)
    row0 = [[t[0] for t in r] for r in runs]
    assert row0[0] == row0[1]  # same seed -> same tokens whatever the neighbours do
    # Alone in a batch of one, the seeded request draws the same tokens too.
    g = make_generator(7, "cpu")
    alone = [int(s.sample(logits[:1], [p], [g]).token_ids[0]) for _ in range(20)]
    assert alone == row0[0]
    assert len(set(alone)) > 1  # it really samples (not greedy)


def test_top_k_and_top_p_restrict_support() -> None:
    s = Sampler()
    logits = _logits(1, seed=3)
    order = logits[0].argsort(descending=True).tolist()
    torch.manual_seed(0)
    seen_k = {
        int(s.sample(logits, [SamplingParams(top_k=3)], [None]).token_ids[0]) for _ in range(300)
    }
    assert seen_k <= set(order[:3]) and len(seen_k) > 1
    probs = logits[0].softmax(-1)[order]
    n_nucleus = int((probs.cumsum(0) < 0.8).sum()) + 1  # smallest prefix reaching 0.8
    seen_p = {
        int(s.sample(logits, [SamplingParams(top_p=0.8)], [None]).token_ids[0]) for _ in range(300)
    }
    assert seen_p <= set(order[:n_nucleus])


def test_empirical_distribution_follows_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    g = make_generator(0, "cpu")
    p = SamplingParams(temperature=0.5, seed=0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[int(Sampler().sample(logits, [p], [g]).token_ids[0])] += 1
    expected = (logits[0] / 0.5).softmax(-1)
    assert torch.allclose(counts / 4000, expected, atol=0.03)


def test_batched_unseeded_rows_follow_their_distribution() -> None:
    """Many rows at once, no generators (the CPU inverse-CDF path draws one uniform per
    row): frequencies match the softmax, and a token cut by top_k is never drawn."""
    torch.manual_seed(0)
    row = torch.tensor([1.5, 1.0, 0.0, -0.5, 3.0])
    logits = row.repeat(6000, 1)
    params = [SamplingParams(temperature=1.0, top_k=4)] * 6000
    got = Sampler().sample(logits, params, [None] * 6000).token_ids
    counts = torch.bincount(torch.as_tensor(got), minlength=5).float()
    assert counts[3] == 0  # the least likely token is outside the top 4
    expected = torch.tensor([1.5, 1.0, 0.0, float("-inf"), 3.0]).softmax(-1)
    assert torch.allclose(counts / 6000, expected, atol=0.02)


def test_logprobs_with_alternatives() -> None:
    logits = _logits(2)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)]
    out = Sampler().sample(logits, params, [None, None])
    assert out.chosen_logprobs is not None and out.top_ids is not None
    ref = logits[0].log_softmax(-1)
    tok = int(out.token_ids[0])
    assert abs(float(out.chosen_logprobs[0]) - ref[tok].item()) < 1e-5
    assert out.top_ids[0, :3].tolist() == ref.topk(3).indices.tolist()


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.tensor([[4.0, 3.5, 0.0, -1.0, -2.0]])
    p = SamplingParams(temperature=1.0, min_p=0.3)
    seen = {int(Sampler().sample(logits, [p], [None]).token_ids[0]) for _ in range(400)}
    # p(1)/p(0) = e^-0.5 = 0.61 >= 0.3 stays; p(2)/p(0) = e^-4 is dropped.
    assert seen == {0, 1}


def test_logit_bias_moves_the_greedy_pick() -> None:
    logits = _logits(2)
    low = int(logits[0].argmin())
    params = [
        SamplingParams(temperature=0.0, logit_bias={low: 100.0}),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler().sample(logits, params, [None, None]).token_ids.tolist()
    assert out == [low, int(logits[1].argmax())]  # the other row is untouched


def test_penalties_use_device_counts_and_bump_them() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.5, -0.2], [3.0, 2.9, 0.5, -0.2]])
    state = PenaltyState(4, torch.device("cpu"))
    rows = [state.row("a"), state.row("b")]
    # a generated token 0 twice; b has token 0 only in its prompt.
    state.init_rows(rows, [[3], [0]], [[0, 0], []])
    s = Sampler()
    presence = SamplingParams(temperature=0.0, presence_penalty=0.5)  # 3.0 - 0.5 < 2.9
    rep = SamplingParams(temperature=0.0, repetition_penalty=2.0)  # 3.0 / 2 < 2.9
    out = s.sample(logits, [presence, rep], [None, None], rows, state)
    assert out.token_ids.tolist() == [1, 1]
    assert state.counts[rows[0]].tolist() == [2, 1, 0, 0]  # the sample was counted
    assert state.counts[rows[1]].tolist() == [0, 1, 0, 0]
    # frequency: 0.05 per occurrence; token 1 now seen once, token 0 twice:
    # 3.0 - 0.1 = 2.9 vs 2.9 - 0.05 = 2.85 -> token 0 wins again.
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.05)
    out = s.sample(logits[:1], [freq], [None], rows[:1], state)
    assert out.token_ids.tolist() == [0]
    # The rows are reset when a request is re-prefilled (after a preemption).
    state.init_rows(rows[:1], [[3]], [[]])
    assert state.counts[rows[0]].tolist() == [0, 0, 0, 0]
    assert state.prompt_mask[rows[0]].tolist() == [False, False, False, True]


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_repeats() -> None:
    logits = _logits(3).cuda()
    p = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=5)] * 3
    runs = []
    for _ in range(2):
        gens = [make_generator(5, "cuda") for _ in range(3)]
        runs.append([Sampler().sample(logits, p, gens).token_ids.tolist() for _ in range(10)])
    assert runs[0] == runs[1]
