"""Workloads: exact token counts, seeded determinism, shared prefixes, length distributions."""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest
from toy_tokenizer import make_tokenizer

from bench.workloads import (
    SPECS,
    WORKLOAD_NAMES,
    WordPool,
    WorkloadGenerator,
    encode_ids,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tok() -> Any:
    return make_tokenizer()


@pytest.fixture(scope="module")
def pool(tok: Any) -> WordPool:
    return WordPool(tok)


def _check_exact(tok: Any, reqs: list) -> None:
    for r in reqs:
        if r.api == "chat":
            assert len(encode_ids(tok, r.prompt_text)) == r.num_prompt_tokens
        else:
            ids = r.query_token_ids + r.item_token_ids
            assert len(ids) == r.num_prompt_tokens
            # The ids are what a text client would send, too: decode/encode round-trips.
            assert encode_ids(tok, tok.decode(ids)) == ids


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_prompt_token_counts_are_exact(tok, pool, name):
    scale = 0.005 if name == "credit-verification" else 0.02
    reqs = WorkloadGenerator(name, tok, seed=7, scale=scale, pool=pool).take(40)
    _check_exact(tok, reqs)
    assert all(r.max_output_tokens >= 1 for r in reqs)
    assert len({r.request_id for r in reqs}) == len(reqs)


def test_same_seed_same_requests_other_seed_other_requests(tok, pool):
    def key(reqs: list) -> list:
        return [
            (r.prompt_text, r.query_token_ids, r.item_token_ids, r.max_output_tokens) for r in reqs
        ]

    for name in ("mixed", "post-recommendation"):
        a = WorkloadGenerator(name, tok, seed=1, scale=0.02, pool=pool).take(30)
        b = WorkloadGenerator(name, tok, seed=1, scale=0.02).take(30)  # its own pool
        c = WorkloadGenerator(name, tok, seed=2, scale=0.02, pool=pool).take(30)
        assert key(a) == key(b)
        assert key(a) != key(c)


def test_post_recommendation_shares_per_user_profiles(tok, pool):
    scale = 0.02
    reqs = WorkloadGenerator("post-recommendation", tok, seed=3, scale=scale, pool=pool).take(200)
    by_user: dict[str, list] = {}
    for r in reqs:
        by_user.setdefault(r.group, []).append(r)
    assert len(by_user) == 20  # 200 requests over 20 users: all appear
    profiles = {}
    for user, rs in by_user.items():
        first = rs[0].query_token_ids
        assert all(r.query_token_ids == first for r in rs)  # really shared
        assert 11_000 * scale - 1 <= len(first) <= 17_000 * scale + 1
        assert all(len(r.item_token_ids) == round(150 * scale) for r in rs)
        profiles[user] = tuple(first)
    assert len(set(profiles.values())) == 20  # users differ
    # A request's prompt is its user's profile followed by the post.
    r = reqs[0]
    assert r.num_prompt_tokens == len(r.query_token_ids) + len(r.item_token_ids)


def test_credit_verification_users_and_lengths(tok, pool):
    scale = 0.005
    reqs = WorkloadGenerator("credit-verification", tok, 4, scale, pool=pool).take(300)
    groups = {r.group for r in reqs}
    assert 50 <= len(groups) <= 60  # 60 users, 300 uniform draws
    assert all(40_000 * scale - 1 <= len(r.query_token_ids) <= 60_000 * scale + 1 for r in reqs)


def test_score_items_end_with_the_yes_no_question_at_full_scale(tok, pool):
    gen = WorkloadGenerator("post-recommendation", tok, seed=0, scale=1.0, pool=pool, verify=False)
    item = gen._score_item(random.Random(0), 150)
    assert len(item) == 150
    assert tok.decode(item).endswith("Answer with Yes or No:")


def test_length_distributions_match_specs():
    rng = random.Random(0)

    def sample(dist: Any, n: int = 20_000) -> list[int]:
        return [dist.sample(rng, 1.0) for _ in range(n)]

    long_data, arxiv = sample(SPECS["long-data"].prompt), sample(SPECS["arxiv"].prompt)
    assert statistics.mean(long_data) == pytest.approx(5_900, rel=0.03)
    assert statistics.mean(arxiv) == pytest.approx(3_800, rel=0.03)
    short = sample(SPECS["short-scoring"].prompt)
    assert min(short) >= 256 and max(short) <= 2_048
    assert statistics.mean(short) == pytest.approx((256 + 2_048) / 2, rel=0.03)
    profiles = sample(SPECS["post-recommendation"].prompt)
    assert min(profiles) >= 11_000 and max(profiles) <= 17_000
    histories = sample(SPECS["credit-verification"].prompt)
    assert min(histories) >= 40_000 and max(histories) <= 60_000
    share_in, share_out = sample(SPECS["sharegpt"].prompt), sample(SPECS["sharegpt"].output)
    assert statistics.mean(share_in) == pytest.approx(250, rel=0.1)
    assert statistics.mean(share_out) == pytest.approx(200, rel=0.1)
    assert max(share_in) <= 2_048


def test_scale_shrinks_lengths_proportionally(tok, pool):
    full = [SPECS["arxiv"].prompt.sample(random.Random(i), 1.0) for i in range(300)]
    tenth = [SPECS["arxiv"].prompt.sample(random.Random(i), 0.1) for i in range(300)]
    assert statistics.mean(tenth) == pytest.approx(statistics.mean(full) / 10, rel=0.01)
    reqs = WorkloadGenerator("arxiv", tok, 0, 0.02, pool=pool).take(100)
    assert statistics.mean(r.num_prompt_tokens for r in reqs) == pytest.approx(76, rel=0.15)


def test_mixed_is_sixty_forty(tok, pool):
    reqs = WorkloadGenerator("mixed", tok, 9, 0.005, pool=pool, verify=False).take(2_000)
    share = sum(r.source == "sharegpt" for r in reqs) / len(reqs)
    assert share == pytest.approx(0.6, abs=0.04)
    assert {r.source for r in reqs} == {"sharegpt", "long-data"}
    assert all(r.api == "chat" for r in reqs)


def test_bad_arguments(tok, pool):
    with pytest.raises(ValueError):
        WorkloadGenerator("nope", tok, 0, pool=pool)
    with pytest.raises(ValueError):
        WorkloadGenerator("arxiv", tok, 0, scale=1.5, pool=pool)


def test_real_tokenizer_exact_counts():
    """With the server's own tokenizer (the default SmolLM2 model), counts are exact too."""
    try:
        from runtime.model.convert import ensure_default_model  # noqa: F401
    except ImportError:
        pytest.skip("runtime.model.convert not available yet")
    tok = load_tokenizer(None)
    pool = WordPool(tok)
    for name in ("post-recommendation", "mixed", "short-scoring"):
        reqs = WorkloadGenerator(name, tok, seed=1, scale=0.05, pool=pool).take(20)
        _check_exact(tok, reqs)
    gen = WorkloadGenerator("post-recommendation", tok, seed=1, scale=1.0, pool=pool)
    assert gen._label_ids == [encode_ids(tok, " Yes")[0], encode_ids(tok, " No")[0]]


def test_a_stream_of_users_brings_cold_profiles_throughout(tok, pool):
    """post-recommendation-stream: a new user's first request about 1 in 20, spread over the
    run, every other request one of the 20 latest users'; the first 20 users are the ones
    priming warms; reproducible by seed."""
    name = "post-recommendation-stream"
    gen = WorkloadGenerator(name, tok, seed=5, scale=0.005, pool=pool, verify=False)
    reqs = gen.take(2000)
    users = [int(r.group.removeprefix("user")) for r in reqs]
    firsts = [i for i, u in enumerate(users) if u >= 20 and u not in users[:i]]
    assert 70 <= len(firsts) <= 130  # 2000 / 20 = 100 expected
    assert firsts[0] < 200 and firsts[-1] > 1800  # throughout the run, not at its start
    newest = 19
    for u in users:
        assert newest - 19 <= u <= newest + 1
        newest = max(newest, u)
    # A new user's profile is its own; its later requests share it.
    u = users[firsts[0]]
    profiles = {tuple(r.query_token_ids) for r in reqs if r.group == f"user{u}"}
    assert len(profiles) == 1
    assert {r.group for r in gen.group_requests()} == {f"user{i}" for i in range(20)}
    again = WorkloadGenerator(name, tok, seed=5, scale=0.005, pool=pool, verify=False)
    assert [r.group for r in again.take(2000)] == [r.group for r in reqs]


def test_post_recommendation_draws_the_same_users_as_before_the_stream_variant(tok, pool):
    """The fixed-user workloads keep their draws (runs and simulator replays pair by seed)."""
    reqs = WorkloadGenerator("post-recommendation", tok, seed=0, scale=0.005, pool=pool).take(8)
    rng = random.Random(":".join(("0", "post-recommendation", "requests")))
    expected = []
    for _ in range(8):
        expected.append(f"user{rng.randrange(20)}")
        rng.randrange(50)
    assert [r.group for r in reqs] == expected
