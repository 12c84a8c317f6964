"""Prefix-affinity routing: the routing key of a request and the replica choice (pure Python).

The Ray Serve request router (`app/cluster/router.py`) and the multi-replica simulator
(`bench/sim_cluster.py`) both call `choose`, so what is simulated is what is served.

Routing key (`route_key`), first match wins:
1. an explicit user: the `X-Greenlane-User` or `X-User-Id` header, else the body's OpenAI
   `user` field -> `user:<value>`;
2. the start of the prompt as the client sent it: the first `prefix_tokens` token ids when the
   prompt is token ids (what `bench.serve` and SGLang-style `/v1/score` clients send), else the
   first `prefix_chars` characters of the text (`/v1/score` query or first item when
   `item_first`, chat messages in order, a completions prompt) -> `prefix:<hash>`;
3. none: a prompt shorter than the window shares nothing worth routing for, so it is spread
   like any other request.

The ingress routes before tokenizing, on purpose: it holds no tokenizer or chat template (it
stays light and model-agnostic, and tokenizing twice would cost every request), and equal text
(or id) prefixes are what make equal KV prefixes, so a text hash groups the same requests a
hash of the first token blocks would. The default windows (256 ids, 1,024 characters, about
256 tokens = 16 KV blocks of 16) reach past a short shared instruction into the per-user part
of a prompt; a deployment whose prompts open with a longer common header should raise them.

Choice (`choose`), given each replica's load:
* no key -> power of two choices: two random replicas, the less loaded wins (Ray's default);
* key -> its home. A key seen for the first time is placed on the one of its two first
  rendezvous choices (highest `hash(key, replica)`) that holds fewer keys, and stays there
  (`KeyHomes`); when its home leaves, it is placed again the same way. Two choices keep the
  number of keys per replica close to the mean, where rendezvous hashing alone leaves the
  busiest replica with ~1.5x the mean (20 keys a replica, 64 replicas; bench/sim_cluster.py).
  The home is chosen while `queue(home) <= min queue + max_queue_gap` and, when every replica
  reports a predicted prefill backlog, `backlog(home) <= min backlog + max_backlog_gap_s`;
  otherwise the request spills (`spill`): by default to the less loaded of two random other
  replicas.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

USER_HEADERS = ("x-greenlane-user", "x-user-id")
DEFAULT_PREFIX_TOKENS = 256
DEFAULT_PREFIX_CHARS = 1024


@dataclass(frozen=True, slots=True)
class AffinityConfig:
    """The knobs of the affinity rule (README "More than one GPU")."""

    max_queue_gap: int = 8  # home kept while its queue <= least-loaded queue + this
    max_backlog_gap_s: float | None = 2.0  # same for predicted prefill backlog (None: ignore)
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS  # key window for token-id prompts
    prefix_chars: int = DEFAULT_PREFIX_CHARS  # key window for text prompts
    # Where a request whose home is over the bound goes: "power-of-two" (two random others,
    # the less loaded) or "next-in-order" (the key's next rendezvous choice within the bound,
    # so a user's spills land on one or two replicas that then cache its prefix too).
    spill: str = "power-of-two"

    def __post_init__(self) -> None:
        if self.max_queue_gap < 0:
            raise ValueError("max_queue_gap must be >= 0")
        if self.max_backlog_gap_s is not None and self.max_backlog_gap_s < 0:
            raise ValueError("max_backlog_gap_s must be >= 0")
        if self.spill not in ("power-of-two", "next-in-order"):
            raise ValueError(f"spill must be power-of-two or next-in-order, got {self.spill!r}")
        if self.prefix_tokens < 1 or self.prefix_chars < 1:
            raise ValueError("prefix_tokens and prefix_chars must be >= 1")


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What the router knows about one replica. `queue` is the number of requests the router
    has in flight on it (fresh); the rest come from the replica's periodic stats (stale by up
    to one stats period) and may be missing."""

    queue: int
    prefill_backlog_s: float | None = None
    kv_usage: float | None = None  # used / total KV blocks, 0..1


@dataclass(frozen=True, slots=True)
class Choice:
    """Replicas in order of preference (ranks: the caller tries each rank in turn; within a
    rank the least-loaded replica that accepts wins) and why."""

    ranks: list[list[str]]
    reason: str  # "home" | "spill" | "no-key" | "single"


# ----------------------------------------------------------------------------- keys


def _digest(kind: str, payload: str) -> str:
    return kind + ":" + hashlib.blake2b(payload.encode("utf-8"), digest_size=8).hexdigest()


def _ids_key(ids: Sequence[Any], prefix_tokens: int) -> str | None:
    if len(ids) < prefix_tokens or not all(isinstance(t, int) for t in ids[:prefix_tokens]):
        return None
    return _digest("prefix", "ids:" + ",".join(str(t) for t in ids[:prefix_tokens]))


def _text_key(text: str, prefix_chars: int) -> str | None:
    if len(text) < prefix_chars:
        return None
    return _digest("prefix", "text:" + text[:prefix_chars])


def _messages_text(messages: Any, limit: int) -> str:
    """Chat messages as `role\\x00content\\x00...`, stopping once `limit` characters are
    collected (equal message prefixes render to equal template prefixes)."""
    parts: list[str] = []
    size = 0
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            break
        content = m.get("content")
        if isinstance(content, list):  # text parts
            content = "".join(
                p.get("text") or "" for p in content if isinstance(p, dict) and p.get("text")
            )
        piece = f"{m.get('role', '')}\x00{content if isinstance(content, str) else ''}\x00"
        parts.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return "".join(parts)


def _prompt_key(path: str, body: Mapping[str, Any], cfg: AffinityConfig) -> str | None:
    if path.endswith("/score"):
        if body.get("messages") is not None:
            return _text_key(_messages_text(body["messages"], cfg.prefix_chars), cfg.prefix_chars)
        first = body.get("query")
        if body.get("item_first"):
            items = body.get("items")
            first = items[0] if isinstance(items, list) and items else items
        prompt = first
    elif path.endswith("/chat/completions"):
        return _text_key(_messages_text(body.get("messages"), cfg.prefix_chars), cfg.prefix_chars)
    elif path.endswith("/completions"):
        prompt = body.get("prompt")
        # A batch of prompts: route on the first (one request goes to one replica).
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            prompt = prompt[0]
    else:
        return None
    if isinstance(prompt, str):
        return _text_key(prompt, cfg.prefix_chars)
    if isinstance(prompt, list):
        return _ids_key(prompt, cfg.prefix_tokens)
    return None


def route_key(
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    cfg: AffinityConfig | None = None,
) -> str | None:
    """The routing key of one HTTP request (see the module docstring); None = no affinity.

    `headers` must have lower-case names. Never raises: a body that is not JSON has no key
    (the replica answers it with its own 400)."""
    cfg = cfg or AffinityConfig()
    for name in USER_HEADERS:
        value = headers.get(name)
        if value:
            return _digest("user", value)
    if not body:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(parsed, dict):
        return None
    user = parsed.get("user")
    if isinstance(user, str) and user:
        return _digest("user", user)
    return _prompt_key(path, parsed, cfg)


# ----------------------------------------------------------------------------- choice


def rendezvous_order(key: str, replica_ids: Sequence[str]) -> list[str]:
    """Replicas ranked for `key`, best first (highest random weight hashing)."""

    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def power_of_two(replica_ids: Sequence[str], rng: random.Random) -> list[str]:
    """Two distinct random replicas (one if there is only one)."""
    if len(replica_ids) <= 2:
        pair = list(replica_ids)
        rng.shuffle(pair)
        return pair
    return rng.sample(list(replica_ids), 2)


def home_is_within_bound(
    home: ReplicaLoad, loads: Sequence[ReplicaLoad], cfg: AffinityConfig
) -> bool:
    """The affinity bound: the home's queue (and backlog, when every replica reports one)
    is within the configured gap of the least-loaded replica's."""
    if home.queue > min(r.queue for r in loads) + cfg.max_queue_gap:
        return False
    backlogs = [r.prefill_backlog_s for r in loads]
    if cfg.max_backlog_gap_s is not None and all(b is not None for b in backlogs):
        assert home.prefill_backlog_s is not None
        if home.prefill_backlog_s > min(b for b in backlogs if b is not None) + (
            cfg.max_backlog_gap_s
        ):
            return False
    return True


class KeyHomes:
    """Two-choice home placement: a key seen for the first time is placed on whichever of its
    two rendezvous choices holds fewer keys, and stays there (bounded LRU map). Key counts per
    replica then stay within a few keys of the mean (balls into bins with two choices), where
    plain rendezvous hashing leaves the busiest replica ~1.5x the mean at 20 keys a replica.

    State is per router instance: two ingress replicas may place a new key differently, so a
    key has at most two homes (its two choices)."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[str, str] = OrderedDict()
        self._num_keys: Counter[str] = Counter()

    def order(self, key: str, ids: Sequence[str]) -> list[str]:
        """`ids` in the key's order of preference: its placed home first."""
        ranked = rendezvous_order(key, ids)
        home = self._homes.get(key)
        if home is None or home not in ids:
            first, second = ranked[0], ranked[1] if len(ranked) > 1 else ranked[0]
            home = second if self._num_keys[second] < self._num_keys[first] else first
            self._place(key, home)
        else:
            self._homes.move_to_end(key)
        return [home, *(r for r in ranked if r != home)]

    def _place(self, key: str, home: str) -> None:
        old = self._homes.pop(key, None)
        if old is not None:
            self._num_keys[old] -= 1
        self._homes[key] = home
        self._num_keys[home] += 1
        while len(self._homes) > self.capacity:
            _, evicted = self._homes.popitem(last=False)
            self._num_keys[evicted] -= 1


def choose(
    key: str | None,
    loads: Mapping[str, ReplicaLoad],
    cfg: AffinityConfig,
    rng: random.Random,
    homes: KeyHomes | None = None,
) -> Choice:
    """Where one request should go (see the module docstring). `loads` must not be empty.
    With `homes`, a key's home is placed by two choices (`KeyHomes`), else by rendezvous."""
    ids = sorted(loads)  # a stable order, so a seeded rng reproduces a run
    if len(ids) == 1:
        return Choice([ids], "single")
    if key is None:
        return Choice([power_of_two(ids, rng)], "no-key")
    order = homes.order(key, ids) if homes is not None else rendezvous_order(key, ids)
    home, others = order[0], order[1:]
    everyone = list(loads.values())
    if home_is_within_bound(loads[home], everyone, cfg):
        # If the home turns the request away (full), fall through to a spill at once.
        return Choice([[home], power_of_two(others, rng)], "home")
    if cfg.spill == "next-in-order":
        # The least-loaded replica is always within the bound: the walk ends.
        nxt = next(r for r in others if home_is_within_bound(loads[r], everyone, cfg))
        return Choice([[nxt], power_of_two(others, rng)], "spill")
    return Choice([power_of_two(others, rng)], "spill")
