"""`ModelRunner.run(plan) -> RunnerOutput`: tensors in, tokens and label probabilities out.

A step's prefill part and decode part are separate forward calls, each with its own
`ForwardBatch` and attention backend instance (the same instance unless a second one is
given). That is the seam for running them on two CUDA streams (prefill on one SM partition,
decode on the other); on CPU the two calls simply run one after the other.
"""

from __future__ import annotations

import torch

from runtime.attention.base import AttentionBackend, ForwardBatch, SeqSlice
from runtime.config import EngineConfig
from runtime.kv_pool import KVPool
from runtime.model import LlamaForCausalLM
from runtime.model_config import ModelConfig
from runtime.request import RequestKind
from runtime.sampler import Sampler, make_generator
from runtime.scheduler import RunnerOutput, ScheduledSeq, StepPlan


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        kv_pool: KVPool,
        backend: AttentionBackend,
        decode_backend: AttentionBackend | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.model_config = model_config
        self.kv_pool = kv_pool
        self.device = kv_pool.device
        self.prefill_backend = backend
        self.decode_backend = decode_backend if decode_backend is not None else backend
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}  # seeded requests only

    def release(self, request_id: str) -> None:
        """Forget per-request state (its seeded generator) once it has finished."""
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> RunnerOutput:
        out = RunnerOutput()
        if plan.prefill:
            self._run_part(plan.prefill, False, self.prefill_backend, out)
        if plan.decode:
            self._run_part(plan.decode, True, self.decode_backend, out)
        return out

    # ---- one forward ----------------------------------------------------------------------
    def build_batch(self, seqs: list[ScheduledSeq], is_decode: bool) -> ForwardBatch:
        """Flatten the sequences' new tokens; logits rows = last row of each sequence whose
        step ends its pending tokens (it needs a sampled token or label scores)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        logits_rows: list[int] = []
        for s in seqs:
            start = len(input_ids)
            input_ids.extend(s.input_ids)
            positions.extend(range(s.num_context_tokens, s.num_context_tokens + s.num_new_tokens))
            slices.append(
                SeqSlice(
                    query_start=start,
                    num_query_tokens=s.num_new_tokens,
                    num_context_tokens=s.num_context_tokens,
                    num_kept_tokens=s.num_kept_tokens,
                    block_ids=s.block_ids,
                )
            )
            if s.needs_output:
                logits_rows.append(len(input_ids) - 1)
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
            seqs=slices,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64).to(dev, non_blocking=True),
            is_decode=is_decode,
        )

    def _run_part(
        self,
        seqs: list[ScheduledSeq],
        is_decode: bool,
        backend: AttentionBackend,
        out: RunnerOutput,
    ) -> None:
        batch = self.build_batch(seqs, is_decode)
        backend.plan(batch)
        chunk = None
        if self.config.hybrid_prefill and not is_decode:
            chunk = self.config.prefill_chunk_tokens
        hidden = self.model(batch.input_ids, batch.positions, backend, chunk_tokens=chunk)
        wanting = [s for s in seqs if s.needs_output]
        if not wanting:
            return
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [N, vocab] fp32

        gen_rows = [i for i, s in enumerate(wanting) if s.request.kind == RequestKind.GENERATE]
        score_rows = [i for i, s in enumerate(wanting) if s.request.kind == RequestKind.SCORE]
        if gen_rows:
            reqs = [wanting[i].request for i in gen_rows]
            gens = [self._generator(r.request_id, r.sampling.seed) for r in reqs]
            rows = logits if len(gen_rows) == len(wanting) else logits[gen_rows]
            sampled = self.sampler.sample(rows, [r.sampling for r in reqs], gens)
            for r, tok, lp in zip(reqs, sampled.token_ids, sampled.logprobs, strict=True):
                out.sampled_token_ids[r.request_id] = tok
                if lp is not None:
                    out.logprobs[r.request_id] = lp
        if score_rows:
            probs: list[torch.Tensor] = []
            for i in score_rows:
                req = wanting[i].request
                labels = torch.tensor(req.label_token_ids, dtype=torch.int64, device=logits.device)
                row = logits[i]
                if req.apply_softmax:
                    probs.append(row.index_select(0, labels).softmax(dim=-1))
                else:
                    probs.append(row.softmax(dim=-1).index_select(0, labels))
            flat = torch.cat(probs).tolist()  # one host transfer for all scoring rows
            pos = 0
            for i in score_rows:
                req = wanting[i].request
                n = len(req.label_token_ids)
                out.label_probs[req.request_id] = flat[pos : pos + n]
                pos += n

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = make_generator(seed, self.device)
            self._generators[request_id] = g
        return g
