"""Prefix-affinity routing rule (app/cluster/routing.py): keys, homes, the bound, spills.
Pure Python: no Ray needed."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from app.cluster.config import ClusterConfig
from app.cluster.routing import (
    AffinityConfig,
    KeyHomes,
    ReplicaLoad,
    choose,
    rendezvous_order,
    route_key,
)

CFG = AffinityConfig(max_queue_gap=2, max_backlog_gap_s=1.0, prefix_tokens=8, prefix_chars=20)


def key(path: str, body: dict | bytes, headers: dict[str, str] | None = None) -> str | None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return route_key(path, headers or {}, raw, CFG)


def test_score_key_is_the_first_prefix_tokens_of_the_query() -> None:
    profile = list(range(100, 140))
    a = key("/v1/score", {"query": profile, "items": [[1, 2]], "label_token_ids": [1]})
    b = key("/v1/score", {"query": profile[:8] + [7] * 30, "items": [[3]], "label_token_ids": [1]})
    c = key("/v1/score", {"query": [9] + profile[1:], "items": [[1, 2]], "label_token_ids": [1]})
    assert a is not None and a.startswith("prefix:")
    assert a == b  # only the first 8 ids count
    assert a != c
    # item_first: the items come first in the prompt, so they make the key
    d = key("/v1/score", {"query": [5], "items": [profile], "item_first": True, "labels": ["x"]})
    assert d == a


def test_text_keys_for_chat_and_completions() -> None:
    long_text = "a user's long profile, " * 3
    chat1 = key("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]})
    chat2 = key(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": long_text + "another question"}]},
    )
    assert chat1 is not None and chat1 == chat2
    parts = [{"type": "text", "text": long_text}]
    assert key("/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]}) == chat1
    other_role = key(
        "/v1/chat/completions", {"messages": [{"role": "system", "content": long_text}]}
    )
    assert other_role != chat1
    comp = key("/v1/completions", {"prompt": long_text})
    assert comp is not None and comp == key("/v1/completions", {"prompt": [long_text, "x"]})
    assert key("/v1/completions", {"prompt": list(range(8))}) is not None


def test_short_prompts_and_bad_bodies_have_no_key() -> None:
    assert key("/v1/completions", {"prompt": "short"}) is None
    assert key("/v1/completions", {"prompt": [1, 2, 3]}) is None
    assert key("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) is None
    assert key("/v1/completions", b"{not json") is None
    assert key("/v1/completions", b"[1, 2]") is None
    assert key("/v1/models", b"") is None


def test_explicit_user_wins() -> None:
    body = {"prompt": "short", "user": "alice"}
    assert key("/v1/completions", body) == key("/v1/chat/completions", {"user": "alice"})
    assert key("/v1/completions", body).startswith("user:")
    by_header = key("/v1/completions", {"prompt": "x" * 50}, {"x-user-id": "alice"})
    assert by_header == key("/v1/completions", body)
    assert key("/v1/completions", body, {"x-greenlane-user": "bob"}) != key("/v1/completions", body)


def test_rendezvous_moves_only_the_keys_of_a_removed_replica() -> None:
    replicas = [f"r{i}" for i in range(8)]
    keys = [f"prefix:{i}" for i in range(2000)]
    home = {k: rendezvous_order(k, replicas)[0] for k in keys}
    counts = Counter(home.values())
    assert len(counts) == 8 and min(counts.values()) > 2000 / 8 * 0.7  # spread
    survivors = [r for r in replicas if r != "r3"]
    for k in keys:
        new_home = rendezvous_order(k, survivors)[0]
        if home[k] != "r3":
            assert new_home == home[k]
        else:
            assert new_home == rendezvous_order(k, replicas)[1]  # the key's second choice


def loads(**queues: int) -> dict[str, ReplicaLoad]:
    return {rid: ReplicaLoad(queue=q) for rid, q in queues.items()}


def test_same_key_goes_home_while_within_the_bound() -> None:
    rng = random.Random(0)
    k = "prefix:abc"
    home = rendezvous_order(k, ["a", "b", "c"])[0]
    others = [r for r in "abc" if r != home]
    within = {r: ReplicaLoad(queue=0) for r in "abc"} | {home: ReplicaLoad(queue=2)}
    choice = choose(k, within, CFG, rng)
    assert choice.reason == "home" and choice.ranks[0] == [home]
    assert sorted(choice.ranks[1]) == sorted(others)  # the fallback if home refuses
    over = within | {home: ReplicaLoad(queue=3)}
    spill = choose(k, over, CFG, rng)
    assert spill.reason == "spill" and home not in spill.ranks[0] and len(spill.ranks) == 1


def test_backlog_bound_applies_only_when_every_replica_reports_it() -> None:
    rng = random.Random(0)
    k = "user:x"
    home = rendezvous_order(k, ["a", "b"])[0]
    other = "b" if home == "a" else "a"
    stale = {home: ReplicaLoad(0, prefill_backlog_s=5.0), other: ReplicaLoad(0, 0.5)}
    assert choose(k, stale, CFG, rng).reason == "spill"
    partial = {home: ReplicaLoad(0, prefill_backlog_s=5.0), other: ReplicaLoad(0, None)}
    assert choose(k, partial, CFG, rng).reason == "home"
    no_backlog_rule = AffinityConfig(max_queue_gap=2, max_backlog_gap_s=None)
    assert choose(k, stale, no_backlog_rule, rng).reason == "home"


def test_no_key_is_power_of_two_choices() -> None:
    rng = random.Random(1)
    seen: Counter[str] = Counter()
    for _ in range(300):
        choice = choose(None, loads(a=0, b=0, c=0, d=0), CFG, rng)
        assert choice.reason == "no-key" and len(choice.ranks) == 1
        pair = choice.ranks[0]
        assert len(pair) == 2 and len(set(pair)) == 2
        seen.update(pair)
    assert set(seen) == {"a", "b", "c", "d"}
    assert choose("user:x", loads(a=5), CFG, rng).ranks == [["a"]]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="router"):
        ClusterConfig(router="round-robin")
    with pytest.raises(ValueError, match="min_replicas"):
        ClusterConfig(min_replicas=2)
    with pytest.raises(ValueError, match="max_queue_gap"):
        ClusterConfig(max_queue_gap=-1)
    auto = ClusterConfig(min_replicas=1, max_replicas=4)
    assert auto.num_replicas is None
    assert (
        ClusterConfig(
            replica_settings={"max_num_seqs": 8, "max_queue": 4}
        ).replica_admission_limit()
        == 12
    )


def test_two_choice_homes_stick_and_balance_keys() -> None:
    replicas = [f"r{i:02d}" for i in range(64)]
    homes = KeyHomes()
    placed = {f"user:{i}": homes.order(f"user:{i}", replicas)[0] for i in range(64 * 20)}
    # Sticky: the same key keeps its home; it is one of the key's two rendezvous choices.
    for k, home in list(placed.items())[:200]:
        assert homes.order(k, replicas)[0] == home
        assert home in rendezvous_order(k, replicas)[:2]
    two_choice = max(Counter(placed.values()).values())
    one_choice = max(Counter(rendezvous_order(k, replicas)[0] for k in placed).values())
    assert two_choice <= 20 * 1.3 < one_choice
    # A home that leaves: its keys are placed again among the survivors.
    gone = placed["user:0"]
    survivors = [r for r in replicas if r != gone]
    assert homes.order("user:0", survivors)[0] in rendezvous_order("user:0", survivors)[:2]
    # `choose` with placed homes sends a key to its placed home.
    loads_all = {r: ReplicaLoad(queue=0) for r in survivors}
    choice = choose("user:0", loads_all, CFG, random.Random(0), homes)
    assert choice.ranks[0] == [homes.order("user:0", survivors)[0]]
