"""`StepPacer`: how much prefill each step takes beside the decodes, and where it runs.

The engine's side of the split controller (`SplitController`, cost_model.py), and the TBT cut
that `off --tbt-slo-ms` shares with it. Before a step is planned, `auto_capacity` (split
executor) asks the controller how to run the head of the prefill queue beside the decodes
(`Scheduler.outlook`) and, when it chooses chunked time-slicing, caps the step's prefill at the
decision's chunk; `tbt_cut` (serial executor with a target) gives the scheduler the time
accounting to cut the step's prefill to the target. At launch `choose_split` hands the split
executor the controller's choice for the planned batch (or the chunked decision made before
planning).

Both cut on one decode base (`decode_base_s`: the cost model's decode for the batch when
calibrated, else an average of decode-only steps) and one corrected prefill cost
(`CorrectedCost`, learnt from mixed whole-GPU steps), and aim below the target by measured
tail factors (`TailFactor`: the chunks' and, once measured, the layer slices' own). The engine
feeds it every applied step (`take_chunked_prediction`, `observe_step`,
`observe_decode_only`) and shows its counters in the stats.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any

from policies.jct import JCTModel
from runtime.config import EngineConfig
from runtime.executor.base import StepResult
from runtime.kv.block_manager import BlockManager
from runtime.model.llama import rows_stream_at
from runtime.partition import SplitChoice
from runtime.partition.corrections import CorrectedCost, TailFactor
from runtime.partition.cost_model import (
    PREFILL,
    ChunkInput,
    DecodeShape,
    PrefillShape,
    RowStream,
)
from runtime.scheduler import Scheduler, StepCapacity, StepOutlook, StepPlan

# The engine's logger: these lines are part of its start-up log.
log = logging.getLogger("greenlane.engine")

# The fallback decode base (`StepPacer.decode_base_s`, no calibrated cost model) is an EWMA of
# decode-only steps, each entering at most this many times the current average: one stalled
# step (a host gap inside it, a collector pause) lifted it by a tenth of the stall, and the
# TBT cut planned the steps after it that much shorter until it decayed. A real change of
# batch still moves it by up to 10 % a step.
DECODE_AVG_MAX_JUMP = 2.0


def decode_avg_s(avg_s: float, sample_s: float) -> float:
    """The fallback decode base after one more decode-only step of `sample_s` (0: none yet)."""
    if avg_s == 0.0:
        return sample_s
    return 0.9 * avg_s + 0.1 * min(sample_s, DECODE_AVG_MAX_JUMP * avg_s)


# The least tail factor layer slices aim with once their own tail is measured (`slice_tail`):
# the engine sees a slice's wait on the device, not the API server's delivery after it. On the
# H200 (8B in 24 GB, 80-ms target, fifty-fourth session) a floor of 1.05 bound (the waits'
# own ratio P99 read 1.04): slices aimed at ~76 ms, the waits behind them read P99 78.3 ms on
# the device and the chats 78.6-80.7 ms at the client. 1.08 aims at ~74 (~79 expected).
SLICE_TAIL_FLOOR = 1.08


class StepPacer:
    """Per-step prefill capacity and split choice under a TBT target, and what it learns from
    the steps that ran. `green` is the engine's `GreenContextPartition` (None without green
    contexts: the TBT cut alone, on the decode-only average); `serial` the serial executor,
    whose cap on a step with decodes (`mixed_step_token_budget`, changed at run time) bounds
    auto's chunks too; `max_score_tokens` the longest prompt the activation reserve was sized
    to run whole."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        block_manager: BlockManager,
        serial: Any,
        runner: Any,
        green: Any,
        jct_model: JCTModel,
        num_layers: int,
        max_score_tokens: int,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.serial = serial
        self.runner = runner
        self.green = green
        self.jct_model = jct_model
        self.num_layers = num_layers
        self.max_score_tokens = max_score_tokens
        # --tbt-slo-ms: prefill work per step is cut to fit the target next to the decodes,
        # whose step time is this running average of decode-only steps (serial executor; in
        # auto the controller sizes its chunks with the same arithmetic: auto_capacity).
        self.tbt_s = None if config.tbt_slo_ms is None else config.tbt_slo_ms / 1e3
        # --chunk-fixed-share (auto's chunks beside decodes; `auto_step_cap`): a prefill
        # limit, so it changes at run time with the others (`set_targets`).
        self.chunk_fixed_share = config.chunk_fixed_share
        self.decode_step_avg_s = 0.0
        self.prefill_cost = CorrectedCost(jct_model)
        # Mixed whole-GPU steps (prefill + decodes): how many, how many took longer than the
        # TBT target, and measured / predicted time of the recent ones (the prediction the cut
        # works from: decode step + correction). A target missed at the P99 is read from their
        # tail; the mean alone is what the correction fits.
        self.num_mixed_steps = 0
        self.num_mixed_steps_over_tbt = 0
        self.mixed_step_ratios: deque[float] = deque(maxlen=512)
        # The cut aims at the target / this factor: the tail of what decodes waited for mixed
        # steps (host gap included) over their prediction. Whole-GPU steps only.
        self.tbt_tail = TailFactor()
        # auto's layer slices aim at the target / this one's factor once it is measured: what
        # decodes waited behind a slice (device gap + their step) over the wait promised
        # (`slice_aim_ms`). Slices miss differently from chunked steps: on an H100 (8B in
        # 24 GB, `58a82b9`) the chunked steps' tail (1.1-1.5 over the run) sized the slices
        # of 50-60k-token prompts to 31-43 ms where ~65 fitted, while the slices' spans
        # read within 3 % of their prediction.
        self.slice_tail = TailFactor(floor=SLICE_TAIL_FLOOR)
        # auto: the controller's choice for the step being planned, when it chose chunks
        # (`auto_capacity`); the launch of that step carries it out (`choose_split`).
        self._planned_choice: SplitChoice | None = None
        self._planned_chunk: ChunkInput | None = None  # its input (to predict that step)
        # step id -> a launched chunked step's predicted ms (scored when its result is in) and
        # the rest of the head its decision predicted (traced)
        self._chunked_predicted_ms: dict[int, tuple[float, float]] = {}
        self._kv_usage_before_plan = 0.0  # KV usage when the current step was planned

    def set_targets(self, tbt_ms: float | None, chunk_fixed_share: float | None) -> None:
        """The TBT target and auto's fixed-part share as changed at run time
        (`Engine.set_prefill_limits`, applied on the engine thread)."""
        self.tbt_s = None if tbt_ms is None else tbt_ms / 1e3
        self.chunk_fixed_share = chunk_fixed_share

    # ---- one prefill model ------------------------------------------------------------------
    def share_prefill_model(self) -> None:
        """One prefill model: the split controller predicts a prefill's whole-GPU latency with
        the JCT model that sizes the chunks (and the cost model adds what SM shares change),
        so auto weighs chunks and splits on one scale. Only while the JCT model is fitted to
        this device (a file, or a calibration run later): its first-principles fallback (an 8B
        model's) would replace a fitted cost model's own prefill base with a guess."""
        jct = self.jct_model
        num_layers = self.num_layers

        def whole_prefill_ms(shape: Any) -> float | None:
            if not jct.calibrated:
                return None
            # The JCT model prices a whole forward; a shape of fewer layers (a row piece of
            # one layer, `SplitController._row_slices`) is that many layers' share of it.
            # Priced whole, no piece of a 53-56k-token prompt ever fitted the aim (H100, 8B
            # in 24 GB): they went to a 112-SM split at 1.2x the whole GPU's time.
            whole_ms = jct.predict_totals_s(shape.num_tokens, shape.attention_pairs) * 1e3
            return whole_ms * shape.num_layers / num_layers

        self.green.share_prefill_model(whole_prefill_ms)
        log.info(
            "partition cost model: whole-GPU prefill from the JCT model while it is fitted to "
            "this device (now: %s)",
            jct.source,
        )
        self._seed_prefill_scale()

    def _seed_prefill_scale(self) -> None:
        """Until the JCT model is fitted to this device, the chunks' marginal cost (`--tbt-slo-ms`
        and auto's) starts scaled to the partition cost model's whole-GPU prefill fit, when
        that is calibrated (a file, the start-up profile or the labelled fallback): the JCT
        fallback is an 8B model's first-principles guess, and the online correction
        (`CorrectedCost`, from mixed steps) would otherwise start from 1. Ratio of the two
        models' whole prefills at the start-up profile's shapes, bounded as the correction."""
        jct, model = self.jct_model, self.green.cost_model
        if jct.calibrated or not model.calibrated:
            return
        layers = self.num_layers
        ratios = []
        for tokens, context in ((4096, 0), (1024, 4096)):
            shape = PrefillShape.from_seqs([(context, tokens)], layers)
            jct_ms = jct.predict_totals_s(shape.num_tokens, shape.attention_pairs) * 1e3
            ratios.append(model.base_ms(PREFILL, shape) / jct_ms)
        scale = min(10.0, max(0.1, sum(ratios) / len(ratios)))
        self.prefill_cost.seed_scale(scale)
        log.info(
            "prefill cost for TBT chunks scaled by %.2f to the partition cost model (%s) until "
            "the JCT model is fitted (now: %s)",
            scale,
            model.source,
            jct.source,
        )

    # ---- before a step is planned -----------------------------------------------------------
    def auto_capacity(self, capacity: StepCapacity) -> StepCapacity:
        """The split executor's step, before it is planned (the KV usage the controller reads
        is noted first, for a step that may plan a prefill). auto with a TBT target: the
        controller chooses how to run the head of the prefill queue beside the decodes,
        chunked time-slicing included (the prefill cut into chunks sized to the target, on
        the whole GPU). When it chooses chunks, the step is planned as `off` plans one, its
        prefill tokens capped at the decision's `chunk_tokens`, and launched on the whole GPU
        with that decision (`choose_split`). Otherwise the step is planned whole and the
        controller chooses for the planned batch at launch (split, layer slices, or a whole
        time-slice)."""
        # Read by the split controller only, and only for a step that may plan a prefill: not
        # on the decode steps between a sliced prompt's slices (budget 0), where counting that
        # prompt's thousands of blocks would buy nothing.
        if capacity.prefill_token_budget > 0:
            self._kv_usage_before_plan = self.kv_usage()
        self._planned_choice = self._planned_chunk = None
        g = self.green
        target_ms = self.chunk_tbt_ms()
        if g is None or g.mode != "auto" or target_ms is None:
            return capacity
        if capacity.prefill_token_budget <= 0:
            return capacity  # a prefill is in flight on a split or in layer slices
        look = self.scheduler.outlook(self.config.chunk_scoring_prefill)
        if not (look.prefill_tokens and look.num_decodes):
            return capacity  # nothing to cut, or nothing to protect: planned whole
        if not look.prefill_chunkable:
            # The head, a scoring prompt that runs whole (no room for its KV, or
            # `--chunk-scoring-prefill false`), is planned whole (the scheduler admits a step's
            # first prefill whatever the room) and the controller chooses at launch how to run
            # it; what is admitted behind it is held to the room, as `off --tbt-slo-ms` holds
            # its admissions. Without that a batch of scoring suffixes that waited on one
            # shared prefix went in as one step: on the H200 (3B, plan z at 8c86337) 20-23
            # suffixes, 2.7-3.4k tokens over 264-288k cached, predicted 73-90 ms and measured
            # 83-86 ms for an 80-ms target, run whole beside the decodes.
            return self.timed(capacity, look, target_ms / 1e3)
        layers = self.num_layers
        p = PrefillShape.from_seqs([(look.prefill_context_tokens, look.prefill_tokens)], layers)
        d = DecodeShape(look.num_decodes, look.decode_context_tokens, layers)
        # The cap on a step with decodes (the serial executor's, `--mixed-step-token-budget`)
        # bounds auto's chunks as it bounds off's steps: decodes share it.
        base_s = self.decode_base_s(look.num_decodes, look.decode_context_tokens)
        cap = self.auto_step_cap(look, base_s, capacity.prefill_token_budget)
        chunk = ChunkInput(
            self.prefill_cost,
            look.prefill_context_tokens,
            target_ms,
            base_s * 1e3,
            self.prefill_cost.offset_s * 1e3,
            max_chunk_tokens=None if cap is None else max(cap - look.num_decodes, 1),
        )
        # Planned whole (a split or layer slices), the head is one sequence of its tokens.
        rows = self.row_stream([(look.prefill_context_tokens, look.prefill_tokens)])
        choice = g.decide(
            p,
            d,
            self._kv_usage_before_plan,
            chunk=chunk,
            record=False,
            rows=rows,
            slice_aim_ms=self.slice_aim_ms(),
        )
        chunk_tokens = choice.decision.chunk_tokens
        if not chunk_tokens:
            # A split or layer slices, predicted for the whole head: the step carries the
            # whole head, not the executor's budget's worth (each piece would be launched and
            # weighed alone, paying the pipeline's fill and drain). On an H100 (8B, 40-44k-token
            # scoring prompts beside chat) such a prompt ran as five 8,192-token pieces on 96
            # SMs, 3.3 s where layer slices take ~1.9 s. Up to the longest prompt the
            # activation reserve was sized to run whole (`max_score_tokens`).
            if capacity.prefill_token_budget < look.prefill_tokens <= self.max_score_tokens:
                return dataclasses.replace(capacity, prefill_token_budget=look.prefill_tokens)
            return capacity
        self._planned_choice, self._planned_chunk = choice, chunk
        # As the serial executor plans a step (decodes share the budget the activation reserve
        # was sized for); the decision's chunk caps the prefill tokens, and the room it was cut
        # to caps their time: the prefills planned behind the head (scoring suffixes over a
        # long cached prefix) cost more a token than its chunk. With the token cap alone, the
        # H200 (3B, scoring next to chat) ran steps predicted at 85-120 ms for an 80 ms aim.
        aim_s = target_ms / 1e3
        return StepCapacity(
            prefill_token_budget=min(
                capacity.prefill_token_budget, chunk_tokens + look.num_decodes
            ),
            decodes_share_budget=True,
            hold_prefills=False,
            chunk_scoring=self.config.chunk_scoring_prefill,
            mixed_step_token_budget=cap,
            tbt_s=aim_s,
            decode_step_s=aim_s - g.chunk_room_ms(d, chunk) / 1e3,
            prefill_cost=self.prefill_cost,
        )

    def tbt_cut(self, capacity: StepCapacity) -> StepCapacity:
        """The serial executor's step with `--tbt-slo-ms`: `capacity` with the TBT cut's time
        accounting (`timed`) for the queue as it stands, aimed at the target over the
        measured tail factor."""
        look = self.scheduler.outlook(self.config.chunk_scoring_prefill)
        return self.timed(capacity, look, self.tbt_s / self.tbt_tail.factor)

    def auto_step_cap(self, look: StepOutlook, base_s: float, budget: int) -> int | None:
        """The most tokens auto's chunked step with decodes may take, decodes included: the
        serial executor's cap (`--mixed-step-token-budget`), raised with `--chunk-fixed-share
        s` to the chunk whose marginal cost is (1 - s) / s times the step's fixed part (the
        decode base `base_s` for the batch, the mixed step's offset and its prefix read: what
        the step costs whatever its chunk), so that part is at most s of the step; never past
        `budget` (the prefill budget the activation reserve was sized for). The TBT target's
        room still bounds the chunk (`SplitController._chunked`)."""
        cap = self.serial.mixed_step_token_budget
        share = self.chunk_fixed_share
        if cap is None or share is None:
            return cap
        cost, ctx = self.prefill_cost, look.prefill_context_tokens
        # The cached prefix's read (`CorrectedCost.context_s_per_token`) is paid whatever the
        # chunk too: fixed, and `max_tokens_within` takes it back out of the chunk's time.
        context_s = cost.context_s_per_token * ctx
        fixed_s = max(0.0, base_s + cost.offset_s + context_s)
        chunk_s = fixed_s * (1.0 - share) / share
        tokens = cost.max_tokens_within(chunk_s + context_s, ctx)
        return min(max(cap, tokens + look.num_decodes), budget)

    def timed(self, capacity: StepCapacity, look: StepOutlook, aim_s: float) -> StepCapacity:
        """`capacity` with the TBT cut's time accounting: the prefill planned beside the
        decodes may add `aim_s` less the decode base for the batch and the mixed step's fixed
        cost (`CorrectedCost`), by the corrected prefill cost. The cap on a step with decodes
        (`mixed_step_token_budget`) stays: the target can only cut such a step shorter."""
        base_s = self.decode_base_s(look.num_decodes, look.decode_context_tokens)
        return dataclasses.replace(
            capacity,
            tbt_s=aim_s,
            decode_step_s=base_s + self.prefill_cost.offset_s,
            prefill_cost=self.prefill_cost,
        )

    def decode_base_s(self, num_decodes: int, context_tokens: int) -> float:
        """The decode part of a mixed whole-GPU step (s): the base the TBT cut subtracts and
        the step offset (`CorrectedCost`) is fitted against, one for both, in auto and in
        `off --tbt-slo-ms` alike. With a calibrated cost model (green contexts), its
        prediction for this batch (decode alone: 0.6-3.3 % MAPE on the H200; in off its
        decode is refined from the serial executor's decode-only steps,
        `observe_decode_only`); else, as a labelled fallback, the average of recent
        decode-only steps. That average goes
        stale under load: decode-only steps then come between bursts of mixed steps and at
        other batch sizes (the 3B's mixed chat on the H200, `8b4553d`: decode-only steps at a
        median 2-46 decodes per window of 512 steps, the mixed steps beside them at 45-170),
        and the offset absorbs the difference, wrong again as soon as the batch changes. On
        the H200 at `c05f523` off-tbt's offset on that base read 7.2 and 19.6 ms at the end of
        two runs (auto's, on the model's base, 0.04 and 10.8), and the run at 19.6 planned its
        chunked steps to a median 53.5 ms against 59.9 and lost a probe of max QPS."""
        g = self.green
        if g is not None and num_decodes > 0:
            layers = self.num_layers
            ms = g.predict_decode_ms(DecodeShape(num_decodes, context_tokens, layers))
            if ms is not None and ms > 0.0:
                return ms / 1e3
        return self.decode_step_avg_s

    # ---- targets ----------------------------------------------------------------------------
    def chunk_tbt_ms(self) -> float | None:
        """auto's aim for chunked time-slicing (ms): its target (`auto_tbt_ms`) divided by the
        measured tail factor."""
        target_ms = self.auto_tbt_ms()
        return None if target_ms is None else target_ms / self.tbt_tail.factor

    def slice_aim_ms(self) -> float | None:
        """auto's aim for layer slices (ms): its target divided by the slices' own measured
        tail (`slice_tail`); None until that is measured (the controller then sizes slices
        to the chunks' aim, with the layer-sliced prediction's error as a margin)."""
        target_ms = self.auto_tbt_ms()
        if target_ms is None or not self.slice_tail.measured:
            return None
        return target_ms / self.slice_tail.factor

    def auto_tbt_ms(self) -> float | None:
        """auto's TBT target itself (ms): `--tbt-slo-ms` (also as changed on the admin page),
        else the controller's (`--partition-tbt-slo-ms`)."""
        if self.tbt_s is not None:
            return self.tbt_s * 1e3
        g = self.green
        return None if g is None else g.controller.config.tbt_slo_ms

    def cut_target_s(self, serial_running: bool) -> float | None:
        """The TBT target the running executor cuts mixed steps to (s), else None: the serial
        executor's `--tbt-slo-ms` (`serial_running`), or auto's target on the split executor.
        Only steps cut to a target are counted against it and teach the tail factor (an
        `off` side with a fixed budget would otherwise fill it with steps no cut sized)."""
        if serial_running:
            return self.tbt_s
        g = self.green
        if g is None or g.mode != "auto":
            return None
        target_ms = self.auto_tbt_ms()
        return None if target_ms is None else target_ms / 1e3

    # ---- at launch --------------------------------------------------------------------------
    def choose_split(self, pplan: StepPlan | None, dplan: StepPlan | None) -> SplitChoice:
        """The controller's split for the next prefill batch (or decode-only step); for a
        prefill planned as chunks (`auto_capacity`), that decision. The split executor's
        `choose`."""
        g = self.green
        num_layers = self.num_layers
        planned = self._planned_choice
        chunk = self._planned_chunk
        if pplan is not None and planned is not None and chunk is not None:
            self._planned_choice = self._planned_chunk = None
            g.record(planned.decision)
            # The planned step's own prediction, scored when it is collected
            # (`take_chunked_prediction`).
            seqs = [] if dplan is None else dplan.decode
            d = DecodeShape(len(seqs), sum(s.num_context_tokens for s in seqs), num_layers)
            items = [(s.num_new_tokens, s.num_context_tokens) for s in pplan.prefill]
            if len(self._chunked_predicted_ms) > 64:
                self._chunked_predicted_ms.clear()  # steps that failed never came back
            self._chunked_predicted_ms[pplan.step_id] = (
                g.predict_chunked_step_ms(items, d, chunk),
                planned.decision.predicted_prefill_ms,
            )
            return planned
        p = (
            None
            if pplan is None
            else PrefillShape.from_seqs(
                [(s.num_context_tokens, s.num_new_tokens) for s in pplan.prefill], num_layers
            )
        )
        if pplan is None:
            d = (
                None
                if dplan is None
                else DecodeShape(
                    len(dplan.decode), sum(s.num_context_tokens for s in dplan.decode), num_layers
                )
            )
        else:
            # A prefill runs beside every decode of its time, not only this step's: those of
            # generations whose (held) prefill is still in flight as well (`decodes_ahead`).
            planned = () if dplan is None else dplan.decode
            num, ctx = self.scheduler.decodes_ahead(planned, pplan.prefill)
            d = DecodeShape(num, ctx, num_layers) if num else None
        # A prefill is judged at the KV usage from before its step was planned: its own blocks
        # are not decode pressure (a whole scoring prompt takes every free block to cache its
        # prefix, which would put every such prompt in the decode-favoured regime), and the
        # decision made before planning (`auto_capacity`) saw the same.
        kv_usage = self._kv_usage_before_plan if pplan is not None else self.kv_usage()
        # Layer slices are sized to an aim (the target less a measured tail), not to the
        # target: a decode waits one slice plus its own step. Their own tail once measured,
        # else the chunks'.
        rows = (
            None
            if pplan is None
            else self.row_stream([(s.num_context_tokens, s.num_new_tokens) for s in pplan.prefill])
        )
        return g.decide(
            p,
            d,
            kv_usage,
            aim_ms=self.chunk_tbt_ms(),
            rows=rows,
            slice_aim_ms=self.slice_aim_ms(),
        )

    def row_stream(self, seqs: list[tuple[int, int]]) -> RowStream | None:
        """The row stream a prefill batch of (context, new tokens) per sequence runs as, if
        it streams its rows (one sequence past the hybrid chunk and the prefill budget, on a
        backend that attends rows): what sub-layer slices cut (`SplitController`)."""
        if len(seqs) != 1 or not hasattr(self.runner.prefill_backend, "attends_rows"):
            return None
        (context, tokens), (chunk, above) = seqs[0], self.config.hybrid_form()
        if chunk is None or not rows_stream_at(tokens, chunk, above):
            return None
        return RowStream(context, tokens, chunk)

    def kv_usage(self) -> float:
        """The KV usage the split controller's switch reads as decode pressure: the pool's
        share in use, less the blocks that only running scoring prompts hold. Those go back
        when their prefill ends (the suffix discarded, the prefix evictable), which favouring
        decode only delays. Counted, a whole scoring prompt planned while the previous one's
        last step was still in flight judged the pool full: on an H100 (8B in 24 GB,
        `58a82b9`) such a 50k-token prompt went to the decode-favoured rule once a run.
        O(blocks of running scoring prompts), once a step the split executor plans."""
        bm = self.block_manager
        used = bm.num_used_blocks - self.scheduler.num_sole_scoring_blocks()
        return used / max(bm.num_blocks, 1)

    # ---- after a step ran -------------------------------------------------------------------
    def take_chunked_prediction(self, result: StepResult) -> tuple[float | None, float | None]:
        """A chunked step's prediction made at its launch (`choose_split`), scored against its
        device time: (the step's predicted ms, the rest of the head its decision predicted),
        else (None, None)."""
        chunked_ms, head_ms = self._chunked_predicted_ms.pop(result.plan.step_id, (None, None))
        if chunked_ms is not None and result.device_s is not None:
            self.green.score("chunked/step", chunked_ms, result.device_s * 1e3)
        return chunked_ms, head_ms

    def observe_step(self, result: StepResult, serial_running: bool) -> tuple[float | None, float]:
        """What a step teaches the cut: a mixed whole-GPU step's time beyond its decode part
        (`decode_base_s`), against the JCT model's terms for its prefill parts, corrects it
        (`CorrectedCost`: offset, a scale per term, the cached prefix's read) and, against
        the running executor's target (`cut_target_s`), the tail factor; a decode step behind
        a layer slice teaches the slices' tail. Returns (the cut's prediction for a mixed
        whole-GPU step (s), else None; the decode base it used, else 0.0)."""
        plan = result.plan
        whole = not result.on_split
        base = (
            self.decode_base_s(len(plan.decode), sum(s.num_context_tokens for s in plan.decode))
            if plan.decode and plan.prefill and whole
            else 0.0
        )
        predicted_step_s: float | None = None
        if plan.decode and plan.prefill and result.device_s is not None and base > 0.0 and whole:
            cost = self.prefill_cost
            prefill = cost.prefill((s.num_new_tokens, s.num_context_tokens) for s in plan.prefill)
            step_s = base + cost.extra_s(prefill)  # as the cut saw it
            predicted_step_s = step_s
            self.mixed_step_ratios.append(result.device_s / step_s)
            self.num_mixed_steps += 1
            target_s = self.cut_target_s(serial_running)
            if target_s is not None:
                if result.device_s > target_s:
                    self.num_mixed_steps_over_tbt += 1
                # What the step's decodes waited: the host's gap before it, then the step.
                waited_s = result.device_s + (result.idle_before_s or 0.0)
                self.tbt_tail.observe(step_s, waited_s, target_s)
            cost.observe(prefill, result.device_s - base)
        if (
            result.slice_promised_s is not None
            and result.decode_gap_s is not None
            and result.device_s is not None
        ):
            target_s = self.cut_target_s(serial_running)
            if target_s is not None:
                # What the decodes waited behind the slice: the device gap since their
                # previous step (the slice, and the host if it lagged), then their own step.
                waited_s = result.decode_gap_s + result.device_s
                self.slice_tail.observe(result.slice_promised_s, waited_s, target_s)
        return predicted_step_s, base

    def observe_decode_only(
        self, plan: StepPlan, device_s: float, whole: bool, serial_running: bool
    ) -> None:
        """A decode-only step of `device_s`: on the whole GPU it moves the fallback decode base
        (`decode_avg_s`); in off with a TBT target it also teaches the cost model this
        device's decode (`whole`: not on a split's partition)."""
        if whole:
            self.decode_step_avg_s = decode_avg_s(self.decode_step_avg_s, device_s)
        if whole and self.tbt_s is not None and self.green is not None and serial_running:
            # In off the split executor does not run, so nothing else teaches the cost
            # model this device's decode: the decode base of the TBT cut reads it (plain
            # off, without a target, reads nothing of it: not taught, no hot-path cost).
            shape = DecodeShape(
                len(plan.decode),
                sum(s.num_context_tokens for s in plan.decode),
                self.num_layers,
            )
            self.green.observe_whole_decode(shape, device_s * 1e3)
