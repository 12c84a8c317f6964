"""CPU tests of the partition cost model's profile and calibration file
(runtime/partition/calibrate.py): profile -> fit -> file -> reload with synthetic measures drawn
from a known model; progress lines and the time budget; key and mismatch handling; the
start-up choice (explicit > cached > profile > H200 fallback > uncalibrated); the CLI's
`calibrate --what partition` on an engine without green contexts."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from policies.jct import JCTModel, one_calibration_filename
from runtime.calibrate import read_section, write_section
from runtime.partition.calibrate import (
    CALIBRATION_FORMAT,
    H200_SEED,
    STARTUP_SHAPES,
    PartitionCalibration,
    ProfileShapes,
    calibrate_partition,
    choose_partition_calibration,
    fallback_calibration,
    fit_calibration,
    fit_shapes_to_limits,
    load_partition_calibration,
    partition_calibration_filename,
    pick_splits,
    plan_points,
    profile_partition,
)
from runtime.partition.cost_model import (
    DECODE,
    PREFILL,
    CostModel,
    DecodeShape,
    PrefillShape,
    SaturationCurve,
)

TOTAL = 132
LAYERS = 4
SPLITS = [33, 66, 99]
SHAPES = ProfileShapes(
    prefill=((1024, 0), (4096, 0), (2048, 4096)),
    decode=((8, 1024), (64, 1024), (32, 4096)),
    concurrent=(((4096, 0), (64, 2048)),),
)
DEVICE, MODEL = "Fake GPU", "random:tiny"


def truth() -> CostModel:
    m = CostModel(TOTAL, calibrated=True)
    m.base = {PREFILL: [0.05, 0.09, 0.02], DECODE: [0.3, 0.05, 0.2]}
    m.curve = {PREFILL: SaturationCurve(0.9, 0.6), DECODE: SaturationCurve(0.3, 0.1, 0.4)}
    m.kappa = {PREFILL: 0.05, DECODE: 0.3}
    return m


class FakeGPU:
    """Measures drawn from `truth()`; counts calls."""

    def __init__(self) -> None:
        self.m = truth()
        self.calls: list[tuple] = []

    def prefill_ms(self, num_tokens: int, ctx: int, sms: int) -> float:
        self.calls.append(("prefill", num_tokens, ctx, sms))
        return self.m.predict(PREFILL, PrefillShape.from_seqs([(ctx, num_tokens)], LAYERS), sms)

    def decode_ms(self, batch: int, ctx: int, sms: int) -> float:
        self.calls.append(("decode", batch, ctx, sms))
        return self.m.predict(DECODE, DecodeShape(batch, batch * ctx, LAYERS), sms)

    def concurrent_ms(self, p: tuple[int, int], d: tuple[int, int], ps: int) -> tuple[float, float]:
        self.calls.append(("concurrent", p, d, ps))
        pt = self.m.predict(PREFILL, PrefillShape.from_seqs([(p[1], p[0])], LAYERS), ps, TOTAL - ps)
        dt = self.m.predict(DECODE, DecodeShape(d[0], d[0] * d[1], LAYERS), TOTAL - ps, ps)
        return pt, dt

    def measures(self) -> dict:
        return {
            "measure_prefill_ms": self.prefill_ms,
            "measure_decode_ms": self.decode_ms,
            "measure_concurrent_ms": self.concurrent_ms,
        }


def fake_profile(gpu: FakeGPU | None = None, measures: dict | None = None, **kw: object):
    """`calibrate_partition` on the fake GPU (or `gpu`, with `measures` replacing its measure
    functions) with this module's device, model, splits and shapes, one repeat; `kw` adds to
    or overrides them."""
    gpu = gpu or FakeGPU()
    args: dict = {
        "device": DEVICE,
        "total_sms": TOTAL,
        "model": MODEL,
        "num_layers": LAYERS,
        "splits": SPLITS,
        "shapes": SHAPES,
        "repeats": 1,
        **kw,
    }
    return calibrate_partition(**(measures or gpu.measures()), **args)


def _calibrate(
    tmp_path: Path,
    lines: list[str] | None = None,
    gpu: FakeGPU | None = None,
    measures: dict | None = None,
    **kw: object,
):
    """Profile the fake GPU (or `gpu`, with `measures` replacing its measure functions)."""
    gpu = gpu or FakeGPU()
    cal = fake_profile(
        gpu,
        measures,
        cache_dir=str(tmp_path),
        progress=(lines.append if lines is not None else None),
        **kw,
    )
    return gpu, cal


def test_profile_fit_file_reload_round_trip(tmp_path: Path) -> None:
    gpu, cal = _calibrate(tmp_path)
    path = tmp_path / one_calibration_filename(DEVICE, MODEL)
    assert path.name == "calibration-fake-gpu--random-tiny.json"
    assert cal.path == str(path) and path.is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temp file was renamed
    whole = json.loads(path.read_text())
    assert whole["format"] == "greenlane-calibration/1" and "jct" not in whole
    assert (whole["device"], whole["model"]) == (DEVICE, MODEL)
    data = whole["partition"]
    assert data["format"] == CALIBRATION_FORMAT
    assert (data["device"], data["total_sms"], data["model"]) == (DEVICE, TOTAL, MODEL)
    assert data["created"] and data["source"] == "profile"
    assert data["fit_error"]["kind"] == "in-sample" and data["fit_error"]["mape"] < 0.15
    n_points = len(plan_points(SPLITS, SHAPES, TOTAL))
    assert data["fit_error"]["num_samples"] == len(data["samples"]) == n_points + len(SPLITS)
    back = load_partition_calibration(str(path), device=DEVICE, total_sms=TOTAL, model=MODEL)
    assert back.parameters == cal.parameters and len(back.samples) == len(cal.samples)
    model = back.cost_model()
    assert model.calibrated and model.source == f"calibration:{path}"
    # Held out of the profile: another split and shapes, alone and concurrent.
    t = gpu.m
    for stage, shape, sms, other in [
        (PREFILL, PrefillShape.from_seqs([(1000, 3000)], LAYERS), 50, 0),
        (DECODE, DecodeShape(40, 40 * 3000, LAYERS), 82, 0),
        (DECODE, DecodeShape(64, 64 * 2048, LAYERS), 82, 50),
    ]:
        want = t.predict(stage, shape, sms, other)
        assert model.predict(stage, shape, sms, other) == pytest.approx(want, rel=0.2)
    # Refitting the reloaded samples gives the same parameters (they were saved faithfully).
    again = fit_calibration(back.samples, device=DEVICE, total_sms=TOTAL, model=MODEL)
    assert again.parameters == cal.parameters


def test_profile_order_repeats_and_progress_lines() -> None:
    gpu = FakeGPU()
    lines: list[str] = []
    ticks = iter(range(1000))
    samples = profile_partition(
        gpu.prefill_ms,
        gpu.decode_ms,
        SPLITS,
        SHAPES,
        lines.append,
        total_sms=TOTAL,
        num_layers=LAYERS,
        measure_concurrent_ms=gpu.concurrent_ms,
        repeats=2,
        warmup=1,
        clock=lambda: float(next(ticks)),
    )
    points = plan_points(SPLITS, SHAPES, TOTAL)
    assert len(lines) == len(points) and len(gpu.calls) == 3 * len(points)  # warm-up + 2
    # Whole-GPU points first (the fit's base latencies survive a cut-short profile).
    n_whole = len(SHAPES.prefill) + len(SHAPES.decode)
    assert all(c[3] == TOTAL for c in gpu.calls[: 3 * n_whole])
    assert all("ETA" in ln and "elapsed" in ln for ln in lines)
    assert lines[0].startswith(f"[partition profile 1/{len(points)}]")
    etas = [float(ln.rsplit("ETA", 1)[1].split("s")[0]) for ln in lines]
    assert etas[-1] == 0.0 and etas[0] > 0.0
    concurrent = [s for s in samples if s.other_sms > 0]
    want = {(PREFILL, s, TOTAL - s) for s in SPLITS} | {(DECODE, TOTAL - s, s) for s in SPLITS}
    assert {(s.stage, s.sms, s.other_sms) for s in concurrent} == want


def test_time_budget_stops_the_profile_and_says_so() -> None:
    gpu = FakeGPU()
    lines: list[str] = []
    now = [0.0]

    def prefill(t: int, c: int, s: int) -> float:
        now[0] += 1.0  # each prefill run "takes" a second
        return gpu.prefill_ms(t, c, s)

    samples = profile_partition(
        prefill,
        gpu.decode_ms,
        SPLITS,
        SHAPES,
        lines.append,
        total_sms=TOTAL,
        num_layers=LAYERS,
        repeats=1,
        warmup=0,
        max_seconds=2.5,
        clock=lambda: now[0],
    )
    assert "time budget" in lines[-1]
    assert 0 < len(samples) < len(plan_points(SPLITS, SHAPES, TOTAL, with_concurrent=False))
    with pytest.raises(ValueError, match="cannot fit"):  # no prefill on a partition yet
        fit_calibration(samples, device=DEVICE, total_sms=TOTAL, model=MODEL)


def test_a_split_that_fails_is_recorded_and_skipped(tmp_path: Path) -> None:
    """Seen on the H200: cuBLAS failed on a 12-SM decode partition. The profile marks the split,
    skips its other points, fits on the rest, and says so; the file records it."""
    gpu = FakeGPU()
    broken = TOTAL - SPLITS[-1]  # the decode partition of the last split

    def decode(batch: int, ctx: int, sms: int) -> float:
        if sms == broken:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED")
        return gpu.decode_ms(batch, ctx, sms)

    lines: list[str] = []
    _, cal = _calibrate(
        tmp_path, lines, gpu=gpu, measures={**gpu.measures(), "measure_decode_ms": decode}
    )
    failed = cal.profile["failed_splits"]
    assert list(failed) == [str(SPLITS[-1])] and "CUBLAS_STATUS_EXECUTION_FAILED" in failed["99"]
    assert any("FAILED, split 99 skipped" in ln for ln in lines)
    # Nothing more was measured on the failed split (its concurrent point included) ...
    assert not [c for c in gpu.calls if c[0] == "concurrent" and c[3] == SPLITS[-1]]
    # ... and the other splits were still profiled and fitted.
    assert {s.sms for s in cal.samples if s.stage == PREFILL} >= {TOTAL, *SPLITS[:-1]}
    on_disk = json.loads(Path(str(cal.path)).read_text())
    assert list(on_disk["partition"]["profile"]["failed_splits"]) == ["99"]


def test_a_whole_gpu_failure_is_not_blamed_on_a_split() -> None:
    gpu = FakeGPU()

    def prefill(t: int, c: int, s: int) -> float:
        raise RuntimeError("out of memory")

    failed: dict[int, str] = {}
    with pytest.raises(RuntimeError, match="out of memory"):
        profile_partition(
            prefill,
            gpu.decode_ms,
            SPLITS,
            SHAPES,
            None,
            total_sms=TOTAL,
            num_layers=LAYERS,
            failed_splits=failed,
        )
    assert failed == {}


def test_bad_splits_are_refused() -> None:
    gpu = FakeGPU()
    with pytest.raises(ValueError, match="splits"):
        profile_partition(
            gpu.prefill_ms,
            gpu.decode_ms,
            [0, TOTAL],
            SHAPES,
            None,
            total_sms=TOTAL,
            num_layers=LAYERS,
        )


def test_load_validates_format_sm_count_and_names(tmp_path: Path, caplog) -> None:
    _, cal = _calibrate(tmp_path)
    path = str(cal.path)
    with pytest.raises(ValueError, match="SMs"):
        load_partition_calibration(path, total_sms=TOTAL + 2)
    with pytest.raises(ValueError, match="SMs"):  # not even an explicit file may differ here
        load_partition_calibration(path, total_sms=TOTAL + 2, strict=False)
    with pytest.raises(ValueError, match="device 'Fake GPU'"):
        load_partition_calibration(path, device="Other GPU", total_sms=TOTAL)
    with pytest.raises(ValueError, match="model"):
        load_partition_calibration(path, model="other", total_sms=TOTAL)
    with caplog.at_level(logging.WARNING, logger="greenlane.partition"):
        ok = load_partition_calibration(path, device="Other GPU", total_sms=TOTAL, strict=False)
    assert ok.device == DEVICE and "using it anyway" in caplog.text
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "greenlane-jct/1"}))
    with pytest.raises(ValueError, match="nor an old greenlane-partition/1"):
        load_partition_calibration(str(bad))
    bad.write_text(json.dumps({"format": "greenlane-calibration/1", "jct": {}}))
    with pytest.raises(ValueError, match="no partition section"):
        load_partition_calibration(str(bad))
    data = json.loads(Path(path).read_text())
    del data["partition"]["parameters"]["kappa"]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="malformed"):
        load_partition_calibration(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_partition_calibration(str(bad))


def _choose(tmp_path: Path, **kw: object):
    args: dict = {
        "explicit_path": None,
        "cache_dir": str(tmp_path),
        "device": DEVICE,
        "total_sms": TOTAL,
        "model": MODEL,
        "mode": "auto",
    }
    args.update(kw)
    return choose_partition_calibration(**args)


def test_startup_choice_order(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # Nothing cached: auto profiles (no fallback for this device), off/static start uncalibrated.
    c = _choose(cache)
    assert c.action == "profile" and c.calibration is None and "profiling" in c.reason
    assert c.path == str(cache / one_calibration_filename(DEVICE, MODEL))
    assert not c.cost_model(TOTAL).calibrated
    c = _choose(cache, mode="off")
    assert c.action == "uncalibrated" and "not used" in c.reason and "time-slices" in c.reason
    c = _choose(cache, startup_profile=False)
    assert c.action == "uncalibrated" and "start-up profile is off" in c.reason
    # Cached file for this device and model: used in every mode.
    _, cal = _calibrate(cache)
    for mode in ("auto", "static", "off"):
        c = _choose(cache, mode=mode)
        assert c.action == "cached" and c.path == cal.path and c.cost_model(TOTAL).calibrated
    # ... but not for another model or SM count.
    assert _choose(cache, model="other").action == "profile"
    # Explicit wins over the cache; a missing explicit file is an error, not a fallback.
    explicit = tmp_path / "mine.json"
    cal.save(str(explicit))
    c = _choose(cache, explicit_path=str(explicit))
    assert c.action == "explicit" and c.path == str(explicit)
    with pytest.raises(FileNotFoundError):
        _choose(cache, explicit_path=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="SMs"):
        _choose(cache, explicit_path=str(explicit), total_sms=TOTAL + 2)


def _old_file(cal: PartitionCalibration, folder: Path) -> Path:
    """`cal` written as an old standalone greenlane-partition/1 file (what was cached before
    the one calibration file)."""
    old = folder / partition_calibration_filename(cal.device, cal.model)
    old.write_text(json.dumps(cal.to_dict()))
    return old


def test_old_partition_files_are_still_read_and_logged_once(tmp_path: Path, caplog) -> None:
    _, cal = _calibrate(tmp_path / "profiled")
    cache = tmp_path / "cache"
    cache.mkdir()
    old = _old_file(cal, cache)
    assert old.name == "partition-fake-gpu--random-tiny.json"
    with caplog.at_level(logging.WARNING, logger="greenlane.calibration"):
        c = _choose(cache)
        again = _choose(cache)
    assert c.action == again.action == "cached" and c.path == str(old)
    assert "old greenlane-partition/1 file" in c.reason
    assert c.cost_model(TOTAL).to_dict() == cal.cost_model().to_dict()
    assert caplog.text.count(f"read the old partition file {old}") == 1  # once, not per read
    # Explicit: an old file and the one file both load.
    assert _choose(cache, explicit_path=str(old)).calibration.parameters == cal.parameters
    assert _choose(cache, explicit_path=str(cal.path)).calibration.parameters == cal.parameters
    # The one file wins over the old file once it has a partition section.
    _calibrate(cache)
    c = _choose(cache)
    assert c.action == "cached" and c.path == str(cache / one_calibration_filename(DEVICE, MODEL))
    assert "old greenlane" not in c.reason


def test_a_one_file_with_only_the_jct_section_falls_through(tmp_path: Path) -> None:
    # The JCT calibration was written first (e.g. `serve --calibrate`); the cost model has no
    # section yet: an old partition file if any, else auto profiles into the same file.
    one = tmp_path / one_calibration_filename(DEVICE, MODEL)
    jct = JCTModel(0.01, 1e-4, 1e-9, device=DEVICE, model=MODEL)
    section = jct.to_dict()
    write_section(str(one), "jct", section, device=DEVICE, model=MODEL)
    c = _choose(tmp_path)
    assert c.action == "profile" and c.path == str(one) and "unusable" not in c.reason
    with pytest.raises(ValueError, match="no partition section"):
        _choose(tmp_path, explicit_path=str(one))
    # The profile writes its section beside the JCT one, which is kept.
    _, cal = _calibrate(tmp_path)
    assert cal.path == str(one)
    assert read_section(str(one), "jct")[0] == section
    assert read_section(str(one), "partition")[0] == cal.to_dict()
    assert JCTModel.load(str(one)).coefficients == jct.coefficients
    assert _choose(tmp_path).action == "cached"


def test_unusable_cached_file_is_reported_and_replaced_by_a_profile(tmp_path: Path) -> None:
    _, cal = _calibrate(tmp_path)
    Path(str(cal.path)).write_text("{broken")
    c = _choose(tmp_path)
    assert c.action == "profile" and "unusable" in c.reason


def test_h200_fallback_only_for_that_device_sm_count_and_model(tmp_path: Path) -> None:
    h200 = {"device": "NVIDIA H200", "total_sms": 132, "model": "random:qwen2.5-3b"}
    c = _choose(tmp_path, mode="off", **h200)
    assert c.action == "fallback" and c.calibration is H200_SEED
    assert "FALLBACK" in c.reason.upper() and "H200 run" in c.reason
    model = c.cost_model(132)
    assert model.calibrated and model.source.startswith("fallback")
    c = _choose(tmp_path, **h200)  # auto: profile first, the seed is what it falls back to
    assert c.action == "profile" and c.calibration is H200_SEED
    assert fallback_calibration("NVIDIA H200", 132, "random:llama-3.1-8b") is None
    assert fallback_calibration("NVIDIA H200", 120, "random:qwen2.5-3b") is None
    assert fallback_calibration("NVIDIA H100 80GB HBM3", 132, "random:qwen2.5-3b") is None


def test_h200_fallback_matches_the_published_run() -> None:
    path = Path(__file__).resolve().parent.parent / "bench/results/partition-2026-11-29.json"
    data = json.loads(path.read_text())
    assert data["device"] == H200_SEED.device and data["model"] == H200_SEED.model
    assert data["calibration"]["NVIDIA H200|random:qwen2.5-3b"] == H200_SEED.parameters
    assert data["summary"]["cost_model_mape"] == H200_SEED.fit_error["mape"]


def test_shapes_shrink_to_the_engine_limits_and_splits_are_picked() -> None:
    small = fit_shapes_to_limits(
        STARTUP_SHAPES, max_model_len=512, kv_pool_tokens=2048, max_num_seqs=8
    )
    for t, c in small.prefill:
        assert t + c <= 511 and t >= 16
    for b, c in small.decode:
        assert b <= 8 and b * (c + 1) <= 1024
    for (t, c), (b, dc) in small.concurrent:
        assert t + c <= 511 and b * (dc + 1) + c <= 1024
    same = fit_shapes_to_limits(
        STARTUP_SHAPES, max_model_len=131072, kv_pool_tokens=10**7, max_num_seqs=256
    )
    assert same == STARTUP_SHAPES
    assert pick_splits(list(range(8, 128, 8)), (0.25, 0.5, 0.75), 132) == [32, 64, 96]
    assert pick_splits([8, 16], (0.25, 0.5, 0.75), 132) == [16]  # deduped
    assert pick_splits([], (0.5,), 132) == []


def test_cli_partition_calibration_needs_green_contexts(tmp_path: Path, capsys) -> None:
    from app.cli import main

    rc = main(
        [
            "calibrate",
            "--what",
            "partition",
            "--model",
            "random:tiny",
            "--device",
            "cpu",
            "--cpu-kv-cache-gb",
            "0.05",
            "--calibration-dir",
            str(tmp_path),
            "--log-level",
            "warning",
        ]
    )
    assert rc == 1 and "unavailable: no CUDA device" in capsys.readouterr().err
    assert not os.listdir(tmp_path)
    rc = main(["serve", "--partition-calibration", str(tmp_path / "missing.json")])
    assert rc == 2 and "partition_calibration: no such file" in capsys.readouterr().err
