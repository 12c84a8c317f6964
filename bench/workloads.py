"""Seeded synthetic workloads with exact prompt token counts.

Every prompt is built from token ids of whole words drawn from the server's own tokenizer: a
word token is kept only if decoding it gives one space-led word that encodes back to that same
single id. Word boundaries then fall on pre-tokenizer splits, so decoding a list of such ids and
encoding the text again gives the same list: the prompt length is exact, and the generator checks
it (`_check_exact`). Scoring requests go out as token ids (the `/v1/score` API takes them), so the
server sees exactly these tokens; chat requests go out as text in one user message, and the chat
template adds its own few tokens around it (the server's `usage.prompt_tokens` is recorded too).

No dataset can be downloaded here, so lengths come from documented distributions (`SPECS` and
README). Values marked "assumed" are our choice, not a paper's number.

Determinism: a workload's requests depend only on (name, seed, scale, tokenizer); arrival times
use a separate random stream (bench.serve), so every QPS of a sweep sees the same requests.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Api = Literal["chat", "score"]

_WORD = re.compile(r"^[ \u2581]?[a-z]{3,12}$")  # optional space / SentencePiece marker + a word


class TokenizerLike(Protocol):
    """The subset of `tokenizers.Tokenizer` we need (encode returns an object with `.ids`)."""

    def encode(self, sequence: str, add_special_tokens: bool = ...) -> object: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def get_vocab_size(self) -> int: ...


def load_tokenizer(path: str | None) -> TokenizerLike:
    """Load `tokenizer.json` (a file or a model folder holding one).

    Without a path, use the default model folder (`runtime.model.convert.ensure_default_model()`),
    which is what `python -m app serve` loads by default.
    """
    from pathlib import Path

    from tokenizers import Tokenizer

    if path is None:
        try:
            from runtime.model.convert import ensure_default_model
        except ImportError as exc:  # the converter is another module; say what to do instead
            raise SystemExit(f"no --tokenizer and no default model: {exc}") from exc
        path = str(ensure_default_model())
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    return Tokenizer.from_file(str(p))


def encode_ids(tok: TokenizerLike, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]


class WordPool:
    """Single-token words of a tokenizer; lists of them decode/encode round-trip exactly."""

    def __init__(self, tok: TokenizerLike) -> None:
        self.tok = tok
        ids: list[int] = []
        for token_id in range(tok.get_vocab_size()):
            text = tok.decode([token_id])
            if _WORD.match(text) and text[0] in " \u2581" and encode_ids(tok, text) == [token_id]:
                ids.append(token_id)
        if len(ids) < 100:
            raise ValueError(
                f"tokenizer has only {len(ids)} single-token words; cannot build prompts"
            )
        self.word_ids = ids

    def sample(self, rng: random.Random, num_tokens: int) -> list[int]:
        return [rng.choice(self.word_ids) for _ in range(num_tokens)]

    def text(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def check_exact(self, ids: Sequence[int]) -> str:
        """Decode `ids` and verify the text encodes back to exactly `ids`; returns the text."""
        text = self.text(ids)
        back = encode_ids(self.tok, text)
        if back != list(ids):
            raise AssertionError(
                f"prompt does not round-trip: {len(ids)} ids -> {len(back)} ids after encode"
            )
        return text


@dataclass(slots=True)
class WorkloadRequest:
    """One request of a workload, independent of arrival time.

    For `score`, the prompt is `query_token_ids + item_token_ids` (item last); `query_token_ids`
    is the same list object for every request of one user, so the shared prefix is shared.
    For `chat`, `prompt_text` is the user message, exactly `num_prompt_tokens` tokens long.
    """

    request_id: str
    api: Api
    source: str  # the (sub-)workload that produced it, e.g. "sharegpt" inside "mixed"
    num_prompt_tokens: int
    max_output_tokens: int
    group: str = ""  # shared-prefix group (user id); "" for none
    prompt_text: str = ""
    query_token_ids: list[int] = field(default_factory=list)
    item_token_ids: list[int] = field(default_factory=list)
    label_token_ids: list[int] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Token-length distribution: uniform [low, high], or lognormal with a mean, clipped."""

    kind: Literal["uniform", "lognormal", "fixed"]
    low: int
    high: int
    mean: float = 0.0
    sigma: float = 0.0  # lognormal shape (std of the underlying normal)

    def sample(self, rng: random.Random, scale: float) -> int:
        if self.kind == "fixed":
            value = float(self.low)
        elif self.kind == "uniform":
            value = rng.uniform(self.low, self.high)
        else:
            # mean of lognormal = exp(mu + sigma^2/2): choose mu so the (unclipped) mean is `mean`.
            mu = math.log(self.mean) - self.sigma**2 / 2
            value = min(max(rng.lognormvariate(mu, self.sigma), self.low), self.high)
        return max(1, round(value * scale))


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    api: Api
    description: str
    prompt: LengthDist  # scoring: the per-user prefix (or the whole prompt without groups)
    output: LengthDist = LengthDist("fixed", 1, 1)
    num_users: int = 0  # > 0: per-user shared prefixes
    items_per_user: int = 0
    item: LengthDist = LengthDist("fixed", 0, 0)  # scoring: the per-request suffix
    # > 0: users keep arriving. A request is a new user's first with probability
    # 1 / user_turnover (its profile cold), else one of the `num_users` latest users'; the
    # first `num_users` are the ones priming warms (`group_requests`). 0: the same
    # `num_users` users throughout, so a run that starts from an empty prefix cache opens with
    # all of their profiles cold at once and none after.
    user_turnover: int = 0


# Label suffix appended to scoring items, so the label question is part of the counted tokens.
_SCORE_QUESTION = " Answer with Yes or No:"

_POST_RECOMMENDATION = WorkloadSpec(
    "post-recommendation",
    "score",
    "PrefillOnly post recommendation: 20 users, profile 11k-17k tokens (uniform), "
    "50 posts x 150 tokens per user; request = profile + one post, Yes/No",
    prompt=LengthDist("uniform", 11_000, 17_000),
    num_users=20,
    items_per_user=50,
    item=LengthDist("fixed", 150, 150),
)

SPECS: dict[str, WorkloadSpec] = {
    "post-recommendation": _POST_RECOMMENDATION,
    "post-recommendation-stream": dataclasses.replace(
        _POST_RECOMMENDATION,
        name="post-recommendation-stream",
        description="post recommendation with users arriving: profiles and posts as "
        "post-recommendation; each request is a new user's first with p = 1/20 (a cold "
        "11k-17k-token profile), else one of the 20 latest users'; run primed (the first 20 "
        "cached) for a steady stream of cold profiles instead of a burst at the start",
        user_turnover=20,
    ),
    "credit-verification": WorkloadSpec(
        "credit-verification",
        "score",
        "PrefillOnly credit verification: 60 users, history 40k-60k tokens (uniform); "
        "request = history + a 64-token question (question length assumed), Yes/No",
        prompt=LengthDist("uniform", 40_000, 60_000),
        num_users=60,
        items_per_user=50,
        item=LengthDist("fixed", 64, 64),
    ),
    "short-scoring": WorkloadSpec(
        "short-scoring",
        "score",
        "short prefill-only prompts, 256-2,048 tokens (uniform), no shared prefix, Yes/No",
        prompt=LengthDist("uniform", 256, 2_048),
    ),
    "long-data": WorkloadSpec(
        "long-data",
        "chat",
        "Nexus long-data-like chat: input lognormal mean 5.9k (sigma 0.5, clip 1k-16k); "
        "output lognormal mean 180 (sigma 0.6, clip 16-512; assumed)",
        prompt=LengthDist("lognormal", 1_000, 16_000, mean=5_900, sigma=0.5),
        output=LengthDist("lognormal", 16, 512, mean=180, sigma=0.6),
    ),
    "arxiv": WorkloadSpec(
        "arxiv",
        "chat",
        "Nexus arxiv-summarization-like chat: input lognormal mean 3.8k (sigma 0.5, clip 1k-12k); "
        "output lognormal mean 250 (sigma 0.5, clip 32-768; assumed)",
        prompt=LengthDist("lognormal", 1_000, 12_000, mean=3_800, sigma=0.5),
        output=LengthDist("lognormal", 32, 768, mean=250, sigma=0.5),
    ),
    "sharegpt": WorkloadSpec(
        "sharegpt",
        "chat",
        "ShareGPT-like short chat (synthetic, no dataset): input lognormal mean 250 "
        "(sigma 1.0, clip 4-2,048); output lognormal mean 200 (sigma 0.9, clip 4-1,024); assumed",
        prompt=LengthDist("lognormal", 4, 2_048, mean=250, sigma=1.0),
        output=LengthDist("lognormal", 4, 1_024, mean=200, sigma=0.9),
    ),
}
# `mixed` draws each request from sharegpt (p = 0.6) or long-data (p = 0.4).
MIXED_PARTS: tuple[tuple[str, float], ...] = (("sharegpt", 0.6), ("long-data", 0.4))
WORKLOAD_NAMES: tuple[str, ...] = (*SPECS, "mixed")


def describe(name: str) -> str:
    if name == "mixed":
        return "60% sharegpt + 40% long-data, chat streaming"
    return SPECS[name].description


def _labels(tok: TokenizerLike) -> tuple[list[int], list[str]]:
    """Yes/No label ids when both are single tokens (space-led, as they follow 'No:' text)."""
    ids = [encode_ids(tok, " Yes"), encode_ids(tok, " No")]
    if all(len(i) == 1 for i in ids):
        return [ids[0][0], ids[1][0]], []
    return [], ["Yes", "No"]  # fallback: let the server map label strings


class WorkloadGenerator:
    """Makes the requests of one workload. `pool` may be shared between generators."""

    def __init__(
        self,
        name: str,
        tok: TokenizerLike,
        seed: int,
        scale: float = 1.0,
        pool: WordPool | None = None,
        verify: bool = True,
    ) -> None:
        if name not in WORKLOAD_NAMES:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
        if not 0 < scale <= 1.0:
            raise ValueError("--scale must be in (0, 1]")
        self.name, self.tok, self.seed, self.scale = name, tok, seed, scale
        self.pool = pool or WordPool(tok)
        self.verify = verify
        self._prefixes: dict[tuple[str, int], list[int]] = {}
        self._label_ids, self._label_strs = _labels(tok)
        self._question_ids = encode_ids(tok, _SCORE_QUESTION)
        self._taken: list[WorkloadRequest] = []
        self._it: Iterator[WorkloadRequest] = iter(self)

    def _rng(self, *key: object) -> random.Random:
        # String seeds are hashed deterministically by random.Random (sha512), unlike hash().
        return random.Random(":".join(str(k) for k in (self.seed, self.name, *key)))

    def _prefix(self, spec: WorkloadSpec, user: int) -> list[int]:
        """The user's shared prefix, made once and reused (same list object) by all requests."""
        key = (spec.name, user)
        if key not in self._prefixes:
            rng = self._rng(spec.name, "user", user)
            ids = self.pool.sample(rng, spec.prompt.sample(rng, self.scale))
            if self.verify:
                self.pool.check_exact(ids)
            self._prefixes[key] = ids
        return self._prefixes[key]

    def _score_item(self, rng: random.Random, num_tokens: int) -> list[int]:
        """Item tokens: random words then the Yes/No question, `num_tokens` in all when possible."""
        question = self._question_ids if num_tokens > len(self._question_ids) else []
        return self.pool.sample(rng, num_tokens - len(question)) + question

    def _grouped_score(self, spec: WorkloadSpec, rid: str, user: int, post: int) -> WorkloadRequest:
        """User `user`'s profile + item `post` (grouped scoring workloads)."""
        query = self._prefix(spec, user)
        item_rng = self._rng(spec.name, "item", user, post)
        item = self._score_item(item_rng, spec.item.sample(item_rng, self.scale))
        return self._score_request(spec, rid, query, item, f"user{user}")

    def _score_request(
        self, spec: WorkloadSpec, rid: str, query: list[int], item: list[int], group: str
    ) -> WorkloadRequest:
        if self.verify:
            # The question tokens are not single words; check the whole item round-trips.
            if encode_ids(self.tok, self.pool.text(item)) != item:
                raise AssertionError("score item does not round-trip through the tokenizer")
        return WorkloadRequest(
            rid,
            "score",
            spec.name,
            len(query) + len(item),
            1,
            group=group,
            query_token_ids=query,
            item_token_ids=item,
            label_token_ids=self._label_ids,
            labels=self._label_strs,
        )

    def group_requests(self) -> list[WorkloadRequest]:
        """One request per shared-prefix group, in user order, each with the group's first
        item: what priming the prefix cache sends (`bench.serve --prime-prefixes`). Empty for
        workloads without groups."""
        spec = SPECS.get(self.name)
        if spec is None or spec.api != "score" or not spec.num_users:
            return []
        return [
            self._grouped_score(spec, f"{self.name}-{self.seed}-prime{u}", u, 0)
            for u in range(spec.num_users)
        ]

    def group_prefix_tokens(self) -> dict[str, int]:
        """Tokens of each group's shared prefix: their sum is the workload's working set (what
        a prefix cache must hold for every request after a user's first to hit)."""
        return {r.group: len(r.query_token_ids) for r in self.group_requests()}

    def _make(
        self, spec: WorkloadSpec, index: int, rng: random.Random, newest: list[int]
    ) -> WorkloadRequest:
        """Request `index`. `newest`: the latest user to have arrived ([id], updated here when
        a request is a new user's first: workloads with `user_turnover`)."""
        rid = f"{self.name}-{self.seed}-{index}"
        if spec.api == "score":
            if spec.num_users:
                if not spec.user_turnover:
                    user = rng.randrange(spec.num_users)  # (the draws of every earlier run)
                elif rng.random() < 1.0 / spec.user_turnover:
                    newest[0] += 1
                    user = newest[0]
                else:
                    user = newest[0] - rng.randrange(spec.num_users)
                post = rng.randrange(spec.items_per_user)
                return self._grouped_score(spec, rid, user, post)
            total = spec.prompt.sample(rng, self.scale)
            item_len = min(len(self._question_ids) + 1, total)
            query = self.pool.sample(rng, total - item_len)
            item = self._score_item(rng, item_len)
            return self._score_request(spec, rid, query, item, "")
        num_prompt = spec.prompt.sample(rng, self.scale)
        num_output = spec.output.sample(rng, self.scale)
        ids = self.pool.sample(rng, num_prompt)
        text = self.pool.check_exact(ids) if self.verify else self.pool.text(ids)
        return WorkloadRequest(rid, "chat", spec.name, num_prompt, num_output, prompt_text=text)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        rng = self._rng("requests")
        index = 0
        newest = [SPECS[self.name].num_users - 1 if self.name in SPECS else 0]
        while True:
            if self.name == "mixed":
                pick = rng.random()
                name = MIXED_PARTS[0][0] if pick < MIXED_PARTS[0][1] else MIXED_PARTS[1][0]
            else:
                name = self.name
            yield self._make(SPECS[name], index, rng, newest)
            index += 1

    def take(self, num_requests: int) -> list[WorkloadRequest]:
        """The first `num_requests` requests (cached: sweeps reuse them without regenerating)."""
        while len(self._taken) < num_requests:
            self._taken.append(next(self._it))
        return self._taken[:num_requests]
