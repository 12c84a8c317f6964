"""A stand-in for `runtime.engine.Engine` with the same interface, for testing the HTTP layer.

It runs where the real engine runs: inside the engine core process (runtime/core/process.py),
behind the same sockets, so the app's whole path (IPC, output processor, streaming, abort,
admission) is exercised. It has no model: outputs follow a deterministic rule, on a thread.

- Tokenizer: one token per UTF-8 byte (ids 0..255) plus chat specials; vocabulary of 300. It
  travels to the front end in `info()` (pickled).
- GENERATE: echoes the prompt's non-special tokens, one per step; after one full echo it emits
  EOS (finish "stop") unless `ignore_eos`; `max_tokens` ends it with "length"; a stop token id
  ends it with "stop". (Stop strings are the front end's job.) `logprobs=k`: the chosen token
  at -0.5 and k alternatives below it.
- SCORE: logit(t) = ((sum(prompt) + 7 t) mod 13) / 4 for every vocabulary id t; label probs are
  the softmax over the labels (or over the whole vocabulary without `apply_softmax`).
- `prompt_logprobs=k` (completions echo): the first output carries `fake_prompt_logprobs`;
  `max_tokens == 0` finishes after that first output with no token (finish "length").
- A prompt containing the bytes "FAIL" fails with finish "error" (fault injection).
- Test controls cross the process boundary as `control(name, *args)` (ServerThread.control):
  "pause" / "resume" hold every request in place (queue-full and disconnect tests), "kill"
  simulates a dead engine loop, "added" lists every request added (id, status, token counts).
  KV accounting is one block per `BLOCK_SIZE` tokens of a running request.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from runtime.config import EngineConfig, check_prefill_limits
from runtime.partition import UnavailablePartition
from runtime.request import (
    FINISH_REASONS,
    EngineOutput,
    Request,
    RequestKind,
    RequestStatus,
    TokenLogprob,
)

IM_START, IM_END, PAD = 256, 257, 258
VOCAB_SIZE = 300
SPECIALS = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "<pad>": PAD}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
BLOCK_SIZE = 4
MAX_MODEL_LEN = 256


class FakeTokenizer:
    vocab_size = VOCAB_SIZE
    # As the real tokenizer says it (runtime/tokenizer.py): the most characters one token
    # stands for (a byte stands for at most one; a special token's text for its length), so
    # the API's length check refuses a text too long for any tokenisation before tokenising
    # it, as it does on the real server.
    max_chars_per_token = max(len(s) for s in SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        for piece in _SPECIAL_RE.split(text):
            if piece in SPECIALS:
                ids.append(SPECIALS[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        names = {v: k for k, v in SPECIALS.items()}
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(names.get(i, f"<{i}>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        """A byte token is its byte; a special token its text."""
        if token_id < 256:
            return bytes([token_id])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """The template's tokens with each message's content read as text (bytes), as the
        real tokenizer does: typed special-token text never becomes a control token. Template
        variables (`chat_template_kwargs`, the request's `tools`) show as `[name=value]` text up
        front; a list as its length (`[tools=2]`: the fake context is short)."""
        ids: list[int] = []
        for name, value in sorted(kwargs.items()):
            shown = len(value) if isinstance(value, list) else value
            ids += list(f"[{name}={shown}]".encode())
        for m in messages:
            ids += self.encode(f"<|im_start|>{m['role']}\n")
            ids += list(str(m["content"]).encode("utf-8"))
            ids += self.encode("<|im_end|>\n")
        if continue_final_message:  # the prompt ends inside the last message
            del ids[-len(self.encode("<|im_end|>\n")) :]
        if add_generation_prompt:
            ids += self.encode("<|im_start|>assistant\n")
        return ids

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def fake_logits(prompt_ids: list[int]) -> list[float]:
    base = sum(prompt_ids)
    return [((base + 7 * t) % 13) / 4.0 for t in range(VOCAB_SIZE)]


def fake_label_probs(
    prompt_ids: list[int], label_ids: list[int], apply_softmax: bool
) -> list[float]:
    logits = fake_logits(prompt_ids)
    pool = [logits[t] for t in label_ids] if apply_softmax else logits
    z = sum(math.exp(x) for x in pool)
    return [math.exp(logits[t]) / z for t in label_ids]


def fake_prompt_logprobs(req: Request) -> list[TokenLogprob | None] | None:
    """Prompt logprobs when `sampling.prompt_logprobs` is set: None for the first token; token
    t at position j gets -0.25 * (1 + (t + j) % 4), and is the most likely one (top of its
    alternatives) when (t + j) is even, else token (t + 1) % 256 at -0.1 is."""
    k = req.sampling.prompt_logprobs
    if k is None:
        return None
    out: list[TokenLogprob | None] = [None]
    for j, tok in enumerate(req.prompt_token_ids[1:], start=1):
        lp = -0.25 * (1 + (tok + j) % 4)
        rivals = [(tok, lp)] if (tok + j) % 2 == 0 else [((tok + 1) % 256, -0.1), (tok, lp)]
        rivals += [((tok + 2 + i) % 256, -3.0 - i) for i in range(k)]
        out.append(TokenLogprob(token_id=tok, logprob=lp, top=rivals[:k]))
    return out


class _Running:
    def __init__(self, req: Request):
        self.req = req
        self.echo = [t for t in req.prompt_token_ids if t < 256] or [ord("x")]
        self.first_scheduled_s: float | None = None


class FakeEngine:
    """Same public surface as `runtime.engine.Engine` (see docs/internals.md)."""

    def __init__(
        self,
        config: EngineConfig,
        sink: Callable[[list[EngineOutput]], None],
        step_s: float = 0.002,
    ):
        self.config = config
        self.sink = sink
        self.step_s = step_s
        self.tokenizer = FakeTokenizer()
        self.max_model_len = min(config.max_model_len or MAX_MODEL_LEN, MAX_MODEL_LEN)
        self.max_prompt_tokens = self.max_model_len
        self.max_score_tokens = min(
            config.max_score_tokens or self.max_model_len, self.max_model_len
        )
        self.kv_blocks_total = 1000
        self.policy = config.prefill_policy
        self.prefill_limits: tuple[int, float | None] = (
            config.prefill_token_budget,
            config.tbt_slo_ms,
        )
        self.mixed_step_token_budget = config.mixed_step_tokens(on_cuda=False)
        self.chunk_fixed_share = config.chunk_fixed_share
        self.partition = UnavailablePartition("the fake engine has no GPU")
        self._lock = threading.Lock()
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._running: dict[str, _Running] = {}
        self._gate = threading.Event()
        self._gate.set()
        self._stop = threading.Event()
        self._admitting = True
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self.added: list[Request] = []  # every request ever added
        self._num_cache_resets = 0

    # ------------------------------------------------------------------ public interface

    def info(self) -> dict[str, Any]:
        return {
            "model": self.config.model,
            "max_model_len": self.max_model_len,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_score_tokens": self.max_score_tokens,
            "vocab_size": VOCAB_SIZE,
            "eos_token_ids": [IM_END],
            "max_position_embeddings": MAX_MODEL_LEN,
            "device": "fake",
            "tokenizer": self.tokenizer,
        }

    def start(self) -> None:
        self._thread.start()

    def add(self, req: Request) -> None:
        self.add_many([req])

    def add_many(self, reqs: list[Request]) -> None:
        late = []
        with self._lock:
            for req in reqs:
                self.added.append(req)
                if not self._admitting:
                    late.append(req)
                else:
                    self._inbox.append(req)
        for req in late:
            self._finish_later(req, RequestStatus.FINISHED_ABORTED, "engine is shutting down")

    def abort(self, request_id: str) -> None:
        self.abort_many([request_id])

    def abort_many(self, request_ids: list[str]) -> None:
        with self._lock:
            self._aborts.extend(request_ids)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            used = sum(math.ceil(r.req.num_tokens / BLOCK_SIZE) for r in self._running.values())
            return {
                "num_waiting": len(self._inbox),
                "num_running": len(self._running),
                "kv_blocks_used": used,
                "kv_blocks_total": self.kv_blocks_total,
                "prefix_cached_blocks": 0,
                "prefix_hit_tokens": 0,
                "prefix_query_tokens": sum(r.num_prompt_tokens for r in self.added),
                "policy": self.policy,
                "prefill_token_budget": self.prefill_limits[0],
                "tbt_slo_ms": self.prefill_limits[1],
                "mixed_step_token_budget": self.mixed_step_token_budget,
                "chunk_fixed_share": self.chunk_fixed_share,
                "partition": "off",
                "num_cache_resets": self._num_cache_resets,
                "alive": True,
            }

    def set_policy(self, name: str) -> None:
        from policies import POLICY_NAMES

        if name not in POLICY_NAMES:
            raise ValueError(f"unknown prefill policy {name!r}")
        self.policy = name

    def reset_prefix_cache(self) -> None:
        self._num_cache_resets += 1

    def set_prefill_limits(
        self,
        prefill_token_budget: int,
        tbt_slo_ms: float | None,
        mixed_step_token_budget: int | None,
        chunk_fixed_share: float | None,
    ) -> None:
        """As the engine: the budget may only go down from the configured one."""
        check_prefill_limits(
            prefill_token_budget,
            tbt_slo_ms,
            mixed_step_token_budget,
            self.config.prefill_token_budget,
            chunk_fixed_share,
        )
        self.prefill_limits = (prefill_token_budget, tbt_slo_ms)
        self.mixed_step_token_budget = mixed_step_token_budget
        self.chunk_fixed_share = chunk_fixed_share

    def shutdown(self, grace_s: float = 0.0) -> None:
        with self._lock:
            self._admitting = False
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running and not self._inbox:
                    break
            time.sleep(0.01)
        with self._lock:
            self._aborts.extend(list(self._running) + [r.request_id for r in self._inbox])
        time.sleep(5 * self.step_s)  # let the loop process the aborts
        self._gate.set()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ test controls

    def control(self, name: str, *args: Any) -> Any:
        if name == "pause":
            self._gate.clear()
        elif name == "resume":
            self._gate.set()
        elif name == "kill":  # simulate a dead engine loop
            self._stop.set()
            self._gate.set()
            self._thread.join(timeout=5)
        elif name == "added":
            with self._lock:
                return [
                    {
                        "request_id": r.request_id,
                        "kind": str(r.kind),
                        "status": r.status.name,
                        "prompt_token_ids": list(r.prompt_token_ids),
                        "num_prompt_tokens": r.num_prompt_tokens,
                        "num_output_tokens": r.num_output_tokens,
                        "label_token_ids": list(r.label_token_ids),
                        "apply_softmax": r.apply_softmax,
                        "cache_salt": r.cache_salt,
                        "sampling": dataclasses.asdict(r.sampling),
                    }
                    for r in self.added
                ]
        else:
            raise ValueError(f"unknown control {name!r}")
        return None

    # ------------------------------------------------------------------ engine thread

    def _finish_later(self, req: Request, status: RequestStatus, error: str | None) -> None:
        req.status = status
        req.error = error
        out = EngineOutput(
            request_id=req.request_id,
            finished=True,
            finish_reason=FINISH_REASONS[status],
            error=error,
            num_prompt_tokens=req.num_prompt_tokens,
        )
        threading.Thread(target=self.sink, args=([out],), daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.step_s)
            outs: list[EngineOutput] = []
            with self._lock:
                while self._aborts:
                    rid = self._aborts.popleft()
                    run = self._running.pop(rid, None)
                    waiting = next((r for r in self._inbox if r.request_id == rid), None)
                    if waiting is not None:
                        self._inbox.remove(waiting)
                    req = run.req if run else waiting
                    if req is not None:
                        outs.append(self._out(req, RequestStatus.FINISHED_ABORTED, error="aborted"))
                if self._gate.is_set():
                    while self._inbox:
                        req = self._inbox.popleft()
                        req.status = RequestStatus.RUNNING
                        self._running[req.request_id] = _Running(req)
                        self._running[req.request_id].first_scheduled_s = time.monotonic()
                    for rid in list(self._running):
                        outs.append(self._step(self._running[rid]))
            if outs:
                self.sink(outs)

    def _out(self, req: Request, status: RequestStatus | None, **kw: Any) -> EngineOutput:
        finished = status is not None and status.is_finished
        if finished:
            req.status = status  # type: ignore[assignment]
            req.finish_s = time.monotonic()
            self._running.pop(req.request_id, None)
        now = time.monotonic()
        return EngineOutput(
            request_id=req.request_id,
            finished=finished,
            finish_reason=FINISH_REASONS[status] if finished else None,  # type: ignore[index]
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            ttft_s=(req.first_token_s - req.arrival_s) if req.first_token_s else None,
            e2e_s=(now - req.arrival_s) if finished else None,
            queue_s=0.0,
            **kw,
        )

    def _step(self, run: _Running) -> EngineOutput:
        req = run.req
        if b"FAIL" in bytes(t for t in req.prompt_token_ids if t < 256):
            return self._out(
                req, RequestStatus.FINISHED_ERROR, error="injected fault (prompt contains FAIL)"
            )
        if req.kind == RequestKind.SCORE:
            req.first_token_s = time.monotonic()
            probs = fake_label_probs(req.prompt_token_ids, req.label_token_ids, req.apply_softmax)
            return self._out(req, RequestStatus.FINISHED_STOPPED, label_probs=probs)
        sp = req.sampling
        n = req.num_output_tokens
        # The first step is the prefill: it carries the prompt logprobs when asked for.
        prompt_lps = fake_prompt_logprobs(req) if n == 0 else None
        prompt_kw = {} if prompt_lps is None else {"prompt_logprobs": prompt_lps}
        if sp.max_tokens == 0:  # prefill only: finished with no sampled token
            return self._out(req, RequestStatus.FINISHED_LENGTH, **prompt_kw)
        if n >= len(run.echo) and not sp.ignore_eos:
            req.output_token_ids.append(IM_END)
            return self._out(req, RequestStatus.FINISHED_STOPPED, new_token_ids=[IM_END])
        tok = run.echo[n % len(run.echo)]
        req.output_token_ids.append(tok)
        if req.first_token_s is None:
            req.first_token_s = time.monotonic()
        status: RequestStatus | None = None
        if tok in sp.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= sp.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        logprobs = []
        if sp.logprobs is not None:
            top = [((tok + 1 + j) % 256, -1.5 - j) for j in range(sp.logprobs)]
            logprobs = [
                TokenLogprob(token_id=tok, logprob=-0.5, top=[(tok, -0.5), *top][: sp.logprobs])
            ]
        return self._out(req, status, new_token_ids=[tok], new_logprobs=logprobs, **prompt_kw)
