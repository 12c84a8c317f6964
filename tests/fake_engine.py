"""A stand-in for `runtime.engine.Engine` with the same interface, for testing the HTTP layer.

It has no model: outputs follow a deterministic rule, on a background thread, so the app's
threading (sink -> event loop), streaming, abort and admission paths run for real.

- Tokenizer: one token per UTF-8 byte (ids 0..255) plus chat specials; vocabulary of 300.
- GENERATE: echoes the prompt's non-special tokens, one per step; after one full echo it emits
  EOS (finish "stop") unless `ignore_eos`; `max_tokens` ends it with "length"; stop strings end
  it with "stop" (the stop string is not included). `logprobs=k`: the chosen token at -0.5 and
  k alternatives below it.
- SCORE: logit(t) = ((sum(prompt) + 7 t) mod 13) / 4 for every vocabulary id t; label probs are
  the softmax over the labels (or over the whole vocabulary without `apply_softmax`).
- `prompt_logprobs=k` (completions echo): the first output carries `fake_prompt_logprobs`;
  `max_tokens == 0` finishes after that first output with no token (finish "length").
- A prompt containing the bytes "FAIL" fails with finish "error" (fault injection).
- `pause()` / `resume()` hold every request in place (for queue-full and disconnect tests);
  KV accounting is one block per `BLOCK_SIZE` tokens of a running request.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from runtime.config import EngineConfig
from runtime.request import (
    FINISH_REASONS,
    Request,
    RequestKind,
    RequestOutput,
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
    def __init__(self, req: Request, tokenizer: FakeTokenizer):
        self.req = req
        self.echo = [t for t in req.prompt_token_ids if t < 256] or [ord("x")]
        self.text = ""
        self.tokenizer = tokenizer
        self.first_scheduled_s: float | None = None


class FakeEngine:
    """Same public surface as `runtime.engine.Engine` (see docs/internals.md)."""

    def __init__(
        self, config: EngineConfig, sink: Callable[[RequestOutput], None], step_s: float = 0.002
    ):
        self.config = config
        self.sink = sink
        self.step_s = step_s
        self.tokenizer = FakeTokenizer()
        self.model_config = SimpleNamespace(
            vocab_size=VOCAB_SIZE, eos_token_ids=[IM_END], max_position_embeddings=MAX_MODEL_LEN
        )
        self.max_model_len = min(config.max_model_len or MAX_MODEL_LEN, MAX_MODEL_LEN)
        self.max_prompt_tokens = self.max_model_len
        self.max_score_tokens = min(
            config.max_score_tokens or self.max_model_len, self.max_model_len
        )
        self.kv_blocks_total = 1000
        self.policy = config.prefill_policy
        self._lock = threading.Lock()
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._running: dict[str, _Running] = {}
        self._gate = threading.Event()
        self._gate.set()
        self._stop = threading.Event()
        self._admitting = True
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self.added: list[Request] = []  # every request ever added (tests inspect them)

    # ------------------------------------------------------------------ public interface

    def start(self) -> None:
        self._thread.start()

    def add(self, req: Request) -> None:
        with self._lock:
            self.added.append(req)
            if not self._admitting:
                self._finish_locked_later(
                    req, RequestStatus.FINISHED_ABORTED, "engine is shutting down"
                )
                return
            self._inbox.append(req)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

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
                "partition": "off",
            }

    def set_policy(self, name: str) -> None:
        self.policy = name

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

    def pause(self) -> None:
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def kill(self) -> None:
        """Simulate a dead engine loop."""
        self._stop.set()
        self._gate.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ engine thread

    def _finish_locked_later(self, req: Request, status: RequestStatus, error: str | None) -> None:
        req.status = status
        req.error = error
        out = RequestOutput(
            request_id=req.request_id,
            finished=True,
            finish_reason=FINISH_REASONS[status],
            error=error,
            num_prompt_tokens=req.num_prompt_tokens,
        )
        threading.Thread(target=self.sink, args=(out,), daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.step_s)
            with self._lock:
                while self._aborts:
                    rid = self._aborts.popleft()
                    run = self._running.pop(rid, None)
                    waiting = next((r for r in self._inbox if r.request_id == rid), None)
                    if waiting is not None:
                        self._inbox.remove(waiting)
                    req = run.req if run else waiting
                    if req is not None:
                        self._emit(req, RequestStatus.FINISHED_ABORTED, error="aborted")
                if not self._gate.is_set():
                    continue
                while self._inbox:
                    req = self._inbox.popleft()
                    req.status = RequestStatus.RUNNING
                    self._running[req.request_id] = _Running(req, self.tokenizer)
                    self._running[req.request_id].first_scheduled_s = time.monotonic()
                for rid in list(self._running):
                    self._step(self._running[rid])

    def _emit(self, req: Request, status: RequestStatus | None, **kw: Any) -> None:
        finished = status is not None and status.is_finished
        if finished:
            req.status = status  # type: ignore[assignment]
            req.finish_s = time.monotonic()
            self._running.pop(req.request_id, None)
        now = time.monotonic()
        out = RequestOutput(
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
        self.sink(out)

    def _step(self, run: _Running) -> None:
        req = run.req
        if b"FAIL" in bytes(t for t in req.prompt_token_ids if t < 256):
            self._emit(
                req, RequestStatus.FINISHED_ERROR, error="injected fault (prompt contains FAIL)"
            )
            return
        if req.kind == RequestKind.SCORE:
            req.first_token_s = time.monotonic()
            probs = fake_label_probs(req.prompt_token_ids, req.label_token_ids, req.apply_softmax)
            self._emit(req, RequestStatus.FINISHED_STOPPED, label_probs=probs)
            return
        sp = req.sampling
        n = req.num_output_tokens
        # The first step is the prefill: it carries the prompt logprobs when asked for.
        prompt_lps = fake_prompt_logprobs(req) if n == 0 else None
        prompt_kw = {} if prompt_lps is None else {"prompt_logprobs": prompt_lps}
        if sp.max_tokens == 0:  # prefill only: finished with no sampled token
            self._emit(req, RequestStatus.FINISHED_LENGTH, **prompt_kw)
            return
        if n >= len(run.echo) and not sp.ignore_eos:
            self._emit(req, RequestStatus.FINISHED_STOPPED)
            return
        tok = run.echo[n % len(run.echo)]
        req.output_token_ids.append(tok)
        if req.first_token_s is None:
            req.first_token_s = time.monotonic()
        full = self.tokenizer.decode(req.output_token_ids)
        status: RequestStatus | None = None
        for stop in sp.stop:
            if stop in full:
                full = full[: full.index(stop)]
                status = RequestStatus.FINISHED_STOPPED
        new_text = full[len(run.text) :] if len(full) >= len(run.text) else ""
        run.text = full
        if status is None and req.num_output_tokens >= sp.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        logprobs = []
        if sp.logprobs is not None:
            top = [((tok + 1 + j) % 256, -1.5 - j) for j in range(sp.logprobs)]
            logprobs = [
                TokenLogprob(token_id=tok, logprob=-0.5, top=[(tok, -0.5), *top][: sp.logprobs])
            ]
        self._emit(
            req, status, new_token_ids=[tok], new_text=new_text, new_logprobs=logprobs, **prompt_kw
        )
