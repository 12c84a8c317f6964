"""GreenContextPartition's bookkeeping on CPU: the device layout and the green-context pairs are
stand-ins (the real ones need CUDA; bench/gpu_suite.py checks them on the GPU)."""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import torch
from test_cost_model import truth  # the tests' shared toy cost model

import runtime.partition.gpu as pg
from runtime.partition.cost_model import (
    DECODE,
    PREFILL,
    TIME_SLICE,
    ControllerConfig,
    DecodeShape,
    PrefillShape,
)
from runtime.partition.green_ctx import SmLayout
from runtime.scheduler import StepPlan


class _Stream:
    """A stream stand-in: records what it was made to wait for."""

    def __init__(self) -> None:
        self.waited_for: list[object] = []

    def wait_stream(self, other: object) -> None:
        self.waited_for.append(other)


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> pg.GreenContextPartition:
    layout = SmLayout(total_sms=132, min_partition_sms=8, alignment_sms=8)
    monkeypatch.setattr(pg, "read_sm_layout", lambda _i=0: layout)

    def side() -> types.SimpleNamespace:
        return types.SimpleNamespace(stream=_Stream())

    monkeypatch.setattr(
        pg,
        "create_pairs",
        lambda splits, _i=0: {
            s: types.SimpleNamespace(prefill=side(), decode=side()) for s in splits
        },
    )
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    model = truth(kappa_d=0.05, kappa_p=0.02, decode_r_sat=0.3)
    model.total_sms = 132
    return pg.GreenContextPartition(
        "auto", cost_model=model, controller_config=ControllerConfig(min_gain=0.0)
    )


def test_auto_counts_its_choices_and_logs_changes(manager, caplog) -> None:
    caplog.set_level(logging.INFO, logger="greenlane.partition")
    p = PrefillShape.from_seqs([(0, 8192)], num_layers=4)
    d = DecodeShape(64, 64 * 2048, 32)
    chosen = [manager.decide(p, d, kv_usage=0.2).prefill_sms for _ in range(3)]
    manager.decide(None, d, kv_usage=0.2)  # decode only: not a prefill batch, not counted
    counts = manager.state().choice_counts
    want: dict[str, int] = {}
    for c in chosen:
        want[str(c)] = want.get(str(c), 0) + 1
    assert counts == want and sum(counts.values()) == 3
    assert "auto split:" in caplog.text
    # A new mode starts a new count.
    manager.set_mode("static:64")
    assert manager.state().choice_counts == {}
    assert (
        manager.decide(p, d, kv_usage=0.2).prefill_sms == 64
    )  # pinned: no auto decisions to count
    assert manager.state().choice_counts == {}


def test_time_slice_is_counted_as_zero(manager) -> None:
    manager.controller.config = ControllerConfig(tbt_slo_ms=1e9)  # any wait meets the target
    p = PrefillShape.from_seqs([(0, 512)], num_layers=4)
    assert manager.decide(p, DecodeShape(8, 8 * 2048, 32), kv_usage=0.2).prefill_sms == TIME_SLICE
    assert manager.state().choice_counts == {"0": 1}


def test_a_failed_split_is_taken_out_of_service(manager, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="greenlane.partition")
    p = PrefillShape.from_seqs([(0, 8192)], num_layers=32)
    d = DecodeShape(64, 64 * 2048, 32)
    chosen = manager.decide(p, d, kv_usage=0.2).prefill_sms
    assert chosen in manager.splits
    manager.disable_split(chosen, "RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED")
    assert chosen not in manager.splits and chosen not in manager.controller.splits
    assert "disabled" in caplog.text
    state = manager.state()
    assert state.disabled_splits == {str(chosen): "RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED"}
    assert chosen not in state.splits
    for _ in range(3):  # auto never goes back to it
        assert manager.decide(p, d, kv_usage=0.2).prefill_sms != chosen
    with pytest.raises(ValueError, match="disabled after it failed"):
        manager.set_mode(f"static:{chosen}")


def test_a_pinned_split_that_fails_falls_back_to_off(manager) -> None:
    manager.set_mode("static:112")
    manager.disable_split(112, "launch failure")
    assert manager.mode == "off" and manager.controller.pinned is None
    p = PrefillShape.from_seqs([(0, 512)], num_layers=4)
    assert manager.decide(p, DecodeShape(8, 8 * 2048, 32), kv_usage=0.2).prefill_sms == TIME_SLICE
    manager.disable_split(112, "again")  # idempotent
    assert manager.state().disabled_splits == {"112": "launch failure"}


# ---------------------------------------------------------------- engine set-up (partition.setup)
def test_no_cuda_means_unavailable_with_the_reason() -> None:
    from runtime.config import EngineConfig
    from runtime.partition import UnavailablePartition
    from runtime.partition.setup import make_partition

    setup = make_partition(EngineConfig(model="random:tiny"), torch.device("cpu"), "cpu")
    assert isinstance(setup.manager, UnavailablePartition) and setup.green is None
    assert setup.manager.state().reason == "no CUDA device"


def _stand_in_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.partition.green_ctx as gc

    monkeypatch.setattr(gc, "green_contexts_unavailable_reason", lambda _i=0: "")
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda _d: types.SimpleNamespace(multi_processor_count=132),
    )


def test_setup_loads_the_file_and_keeps_its_failed_splits_disabled(
    manager, monkeypatch: pytest.MonkeyPatch, tmp_path, caplog
) -> None:
    """(`manager` installs the SM-layout / pair / stream stand-ins.)"""
    import json

    from test_partition_calibrate import _calibrate

    from runtime.config import EngineConfig
    from runtime.partition.setup import make_partition

    _stand_in_cuda(monkeypatch)
    _, cal = _calibrate(tmp_path)
    path = Path(str(cal.path))
    data = json.loads(path.read_text())
    data["partition"]["profile"]["failed_splits"] = {"120": "CUBLAS_STATUS_EXECUTION_FAILED (test)"}
    path.write_text(json.dumps(data))
    cfg = EngineConfig(model="random:tiny", partition="auto", partition_calibration=str(cal.path))
    caplog.set_level(logging.INFO, logger="greenlane.partition")
    setup = make_partition(cfg, torch.device("cuda", 0), "Fake GPU")
    assert isinstance(setup.green, pg.GreenContextPartition) and setup.manager is setup.green
    assert setup.calibration_choice.action == "explicit"
    assert 120 not in setup.green.splits and "120" in setup.green.state().disabled_splits
    assert setup.green.mode == "auto" and setup.green.cost_model.calibrated
    assert "splits pre-created" in caplog.text


def test_setup_falls_back_when_the_pairs_cannot_be_made(
    monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    from runtime.config import EngineConfig
    from runtime.partition import UnavailablePartition
    from runtime.partition.setup import make_partition

    _stand_in_cuda(monkeypatch)
    monkeypatch.setattr(
        pg,
        "read_sm_layout",
        lambda _i=0: SmLayout(total_sms=132, min_partition_sms=8, alignment_sms=8),
    )

    def no_pairs(splits, _i=0):
        raise RuntimeError("cuGreenCtxCreate failed (stand-in)")

    monkeypatch.setattr(pg, "create_pairs", no_pairs)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    caplog.set_level(logging.WARNING, logger="greenlane.partition")
    setup = make_partition(
        EngineConfig(model="random:tiny", partition="static:64"), torch.device("cuda", 0), "GPU"
    )
    assert isinstance(setup.manager, UnavailablePartition) and setup.green is None
    assert "could not be created" in setup.manager.state().reason
    assert "falling back to time-slicing" in caplog.text


@pytest.mark.parametrize(
    ("mode", "pinned", "expected"),
    [("auto", None, ["64/68", "96/36"]), ("static", 96, ["96/36"]), ("off", None, [])],
)
def test_split_decode_graphs_are_captured_at_start_up_for_the_mode(
    mode: str, pinned: int | None, expected: list[str]
) -> None:
    """auto captures every usable split's set before serving (a lazy capture stalls the loop
    once per split), static its own, off none."""
    from runtime.partition.setup import capture_split_graphs

    captured: list[str] = []

    def capture_for_streams(streams: dict) -> None:
        for label, stream in streams.items():
            assert stream == f"decode-stream-{label.split('/')[0]}"
            captured.append(label)

    registry = types.SimpleNamespace(capture_errors={})
    runner = types.SimpleNamespace(graph_registry=registry, capture_for_streams=capture_for_streams)
    pairs = {
        n: types.SimpleNamespace(decode=types.SimpleNamespace(stream=f"decode-stream-{n}"))
        for n in (64, 96, 120)
    }
    green = types.SimpleNamespace(
        mode=mode,
        splits=[64, 96],  # 120 disabled: not in splits any more
        controller=types.SimpleNamespace(pinned=pinned),
        layout=types.SimpleNamespace(total_sms=132),
        pairs=pairs,
    )
    assert capture_split_graphs(runner, green) == expected
    assert captured == expected
    no_graphs = types.SimpleNamespace(graph_registry=None)
    assert capture_split_graphs(no_graphs, green) == []


def test_a_split_whose_decode_graphs_fail_to_capture_is_disabled_at_start_up(manager) -> None:
    """(`manager`: a GreenContextPartition over stand-in pairs, auto mode.) cuBLAS failed on
    the 12-SM decode side of 120/12 while its graphs were captured: out of service before
    serving, not after a failed step."""
    from runtime.partition.setup import capture_split_graphs

    registry = types.SimpleNamespace(capture_errors={})
    total = manager.layout.total_sms

    def capture_for_streams(streams: dict) -> None:
        for label in streams:
            if label == f"120/{total - 120}":
                registry.capture_errors[label] = "RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED"

    runner = types.SimpleNamespace(graph_registry=registry, capture_for_streams=capture_for_streams)
    for n, pair in manager.pairs.items():
        pair.decode = types.SimpleNamespace(stream=f"decode-{n}")
    manager.set_mode("auto")
    assert 120 in manager.splits
    labels = capture_split_graphs(runner, manager)
    assert f"120/{total - 120}" not in labels and labels
    assert 120 not in manager.splits
    assert "CUBLAS_STATUS_EXECUTION_FAILED" in manager.state().disabled_splits["120"]


def test_auto_hands_a_layer_sliced_time_slice_to_the_engine(manager) -> None:
    """decide() returns a TIME_SLICE choice whose `layers_per_slice` says how to slice the
    prefill; a decision without a prefill has none."""
    import dataclasses

    from runtime.partition.cost_model import DECODE, PREFILL

    m = manager.cost_model
    p = PrefillShape.from_seqs([(0, 8192)], num_layers=32)
    d = DecodeShape(8, 8 * 2048, 32)
    per_layer = m.predict(PREFILL, p, 132) / 32
    target = m.predict(DECODE, d, 132) + 4.5 * per_layer
    manager.controller.config = dataclasses.replace(
        manager.controller.config, tbt_slo_ms=target, layer_slicing=True, hysteresis_sms=0
    )
    manager.controller.splits = [32, 64]  # only small prefill splits: slicing finishes first
    choice = manager.decide(p, d, kv_usage=0.2)
    assert choice.prefill_sms == TIME_SLICE and choice.layers_per_slice == 4
    assert manager.state().choice_counts == {"layer-sliced": 1}  # the admin page's key
    choice = manager.decide(None, d, kv_usage=0.2)  # decode only
    assert choice.prefill_sms == TIME_SLICE and choice.layers_per_slice is None


def _prefill_beside_eight_decodes() -> tuple[StepPlan, StepPlan]:
    """Stand-in plans for StepPacer.choose_split: an 8,192-token prefill, and 8 decodes of
    2,048 tokens of context (distinct requests)."""
    seq = types.SimpleNamespace
    pplan = StepPlan(
        1, prefill=[seq(num_context_tokens=0, num_new_tokens=8192, request=seq(request_id="p"))]
    )
    dplan = StepPlan(
        2,
        decode=[
            seq(num_context_tokens=2048, num_new_tokens=1, request=seq(request_id=f"d{i}"))
            for i in range(8)
        ],
    )
    return pplan, dplan


def test_the_engine_hands_layer_slices_to_the_pd_loop(manager) -> None:
    """StepPacer.choose_split turns auto's layer-sliced time-slice into the PD loop's choice:
    both streams the whole GPU's, `layers_per_slice` set; a decode-only choice has none."""
    import dataclasses

    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.partition.cost_model import DECODE, PREFILL

    eng = Engine(EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=64), lambda o: None)
    eng.pacer.green = manager
    layers = eng.model_config.num_layers
    pplan, dplan = _prefill_beside_eight_decodes()
    p = PrefillShape.from_seqs([(0, 8192)], num_layers=layers)
    d = DecodeShape(8, 8 * 2048, layers)
    m = manager.cost_model
    target = m.predict(DECODE, d, 132) + 1.5 * m.predict(PREFILL, p, 132) / layers
    manager.controller.config = dataclasses.replace(
        manager.controller.config, tbt_slo_ms=target, layer_slicing=True, hysteresis_sms=0
    )
    manager.controller.splits = [32, 64]
    choice = eng.pacer.choose_split(pplan, dplan)
    assert choice.prefill_sms == TIME_SLICE and choice.layers_per_slice == 1
    assert choice.prefill_stream is choice.decode_stream is manager._whole
    assert eng.pacer.choose_split(None, dplan).layers_per_slice is None


def test_a_prefill_launched_with_no_decode_in_its_step_runs_beside_the_held_chats(manager) -> None:
    """The split executor holds every prefill until applied, so the step after a burst of
    chats' prefills plans no decode. A long prefill launched then runs through the chats'
    next tokens: StepPacer.choose_split gives the controller those chats (`decodes_ahead`) as
    the decode batch, so it slices the prefill rather than giving it the whole GPU as a
    prefill with no decode beside it ("one phase only": 1.6-2.6 s for the chats' second
    tokens on an H100)."""
    import dataclasses

    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.request import Request, RequestKind, SamplingParams
    from runtime.scheduler import StepCapacity, StepPlan

    eng = Engine(EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=64), lambda o: None)
    eng.pacer.green = manager
    layers = eng.model_config.num_layers
    p = PrefillShape.from_seqs([(0, 8192)], num_layers=layers)
    m = manager.cost_model
    # Room for one layer of the prefill beside a small decode batch.
    target = (
        m.predict(DECODE, DecodeShape(8, 8 * 24, layers), 132)
        + 1.5 * m.predict(PREFILL, p, 132) / layers
    )
    manager.controller.config = dataclasses.replace(
        manager.controller.config, tbt_slo_ms=target, layer_slicing=True, hysteresis_sms=0
    )
    manager.controller.splits = [32, 64]
    sched = eng.scheduler
    for i in range(8):
        sched.add(
            Request(
                f"c{i}",
                RequestKind.GENERATE,
                list(range(20 + i, 44 + i)),
                SamplingParams(max_tokens=16),
            )
        )
    chats = sched.schedule(StepCapacity(4096, decodes_share_budget=False, hold_prefills=True))
    assert len(chats.prefill) == 8 and sched.num_held == 8  # in flight, not yet decodes
    seq = types.SimpleNamespace
    pplan = StepPlan(
        9, prefill=[seq(num_context_tokens=0, num_new_tokens=8192, request=seq(request_id="p"))]
    )
    assert sched.decodes_ahead() == (8, 8 * 24)
    choice = eng.pacer.choose_split(pplan, None)
    assert choice.layers_per_slice == 1
    # The chats' own prefill, launched, is no prefill beside their decodes: the whole GPU.
    assert sched.decodes_ahead((), chats.prefill) == (0, 0)
    assert eng.pacer.choose_split(chats, None).layers_per_slice is None
    # With no generation ahead, a lone prefill still gets the whole GPU.
    for i in range(8):
        sched.abort(f"c{i}")
    assert sched.decodes_ahead() == (0, 0)
    assert eng.pacer.choose_split(pplan, None).layers_per_slice is None


def test_the_engine_sizes_layer_slices_to_its_measured_tail(manager) -> None:
    """StepPacer.choose_split hands the controller its aim (the target over the measured tail
    factor, as for chunks), which sizes layer slices (`SplitController._layer_slices`)."""
    import dataclasses

    from runtime.config import EngineConfig
    from runtime.engine import Engine

    eng = Engine(EngineConfig(model="random:tiny", block_size=4, num_kv_blocks=64), lambda o: None)
    eng.pacer.green = manager
    manager.controller.config = dataclasses.replace(
        manager.controller.config, tbt_slo_ms=80.0, layer_slicing=True
    )
    seen: list[float | None] = []
    decide = manager.decide

    def spy(*args, **kwargs):
        seen.append(kwargs.get("aim_ms"))
        return decide(*args, **kwargs)

    manager.decide = spy
    pplan, dplan = _prefill_beside_eight_decodes()
    eng.pacer.tbt_tail.factor = 1.25
    eng.pacer.choose_split(pplan, dplan)
    assert seen == [pytest.approx(64.0)]


def test_layer_slicing_without_a_tbt_target_is_refused_with_the_reason() -> None:
    from runtime.config import EngineConfig

    with pytest.raises(ValueError, match="needs partition_tbt_slo_ms"):
        EngineConfig(partition_layer_slicing=True)
    assert EngineConfig(partition_layer_slicing=True, partition_tbt_slo_ms=100.0)


def test_a_change_of_split_orders_the_new_streams_after_the_old(manager) -> None:
    """decide() binds the decision to its streams; when the split changes, the new streams
    wait for the old ones (KV written on one partition is visible to the next user)."""
    manager.set_mode("static:64")
    p = PrefillShape.from_seqs([(0, 512)], num_layers=4)
    d = DecodeShape(8, 8 * 2048, 32)
    first = manager.decide(p, d, kv_usage=0.2)
    assert first.prefill_sms == 64 and first.decode_sms == 132 - 64
    assert first.prefill_stream is manager.pairs[64].prefill.stream
    manager.set_mode("off")
    second = manager.decide(p, d, kv_usage=0.2)
    assert second.prefill_sms == TIME_SLICE and second.decode_sms == 132
    assert second.prefill_stream is second.decode_stream is manager._whole
    assert set(map(id, manager._whole.waited_for)) == {
        id(first.prefill_stream),
        id(first.decode_stream),
    }
    assert manager.decide(p, d, kv_usage=0.2).decision.reason == "off"  # the same type


def test_the_error_logs_reset_and_the_model_keeps_what_it_learned(manager) -> None:
    """`reset_cost_model_errors` (the admin API's, called by benchmarks before each side)
    empties every kind's log; the corrections the observations taught stay."""
    p = PrefillShape.from_seqs([(0, 4096)], num_layers=4)
    d = DecodeShape(16, 16 * 1024, 4)
    manager.observe("prefill", p, 96, 50.0, 36)
    manager.observe("decode", d, 36, 7.0, 96)
    manager.score("chunked/step", 40.0, 44.0)
    errors = manager.cost_model_errors()
    assert errors["num_observations"] == 3 and errors["num_chunked_step"] == 1
    learned = manager.cost_model.predict("prefill", p, 96, 36)
    assert manager.reset_cost_model_errors() is True
    errors = manager.cost_model_errors()
    assert errors["num_observations"] == 0 and "num_chunked_step" not in errors
    assert manager.cost_model_mape() is None
    assert manager.cost_model.predict("prefill", p, 96, 36) == learned
