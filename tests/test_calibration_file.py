"""The one calibration file per (device, model) (runtime/calibrate.py): `write_section` /
`read_section` round trips (both sections, one, updating one keeps the other), what happens to a
file of another device or model and to an old single-model file at the path written, and the
one profiler (`calibrate_device`) writing both sections of one file on a device with green
contexts (fakes for the engine and its partition profile) or only the JCT one elsewhere."""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path

import pytest
from test_partition_calibrate import (
    DEVICE,
    MODEL,
    TOTAL,
    fake_profile,
)

from policies.jct import JCTModel, one_calibration_filename
from runtime import calibrate as cal_mod
from runtime.calibrate import (
    calibrate_device,
    calibration_file_path,
    read_section,
    write_section,
)
from runtime.partition.calibrate import (
    choose_partition_calibration,
    load_partition_calibration,
)

JCT = {"format": "greenlane-jct/1", "device": DEVICE, "model": MODEL, "coefficients": {}}
PART = {"format": "greenlane-partition/1", "device": DEVICE, "model": MODEL, "total_sms": 132}


def test_write_and_read_both_sections(tmp_path: Path) -> None:
    path = calibration_file_path(str(tmp_path), DEVICE, MODEL)
    assert Path(path).name == one_calibration_filename(DEVICE, MODEL)
    assert write_section(path, "jct", JCT, device=DEVICE, model=MODEL) == path
    # One section: the other reads as absent (None), not as an error.
    assert read_section(path, "jct") == (JCT, False)
    assert read_section(path, "partition") == (None, False)
    write_section(path, "partition", PART, device=DEVICE, model=MODEL)
    data = json.loads(Path(path).read_text())
    assert data["format"] == "greenlane-calibration/1" and data["updated"]
    assert (data["device"], data["model"], data["jct"], data["partition"]) == (
        DEVICE,
        MODEL,
        JCT,
        PART,
    )
    # Updating one section keeps the other.
    newer = {**JCT, "coefficients": {"a_s": 1.0}}
    write_section(path, "jct", newer, device=DEVICE, model=MODEL)
    assert read_section(path, "jct")[0] == newer and read_section(path, "partition")[0] == PART
    assert [p.name for p in tmp_path.iterdir()] == [Path(path).name]  # no temp file left


def test_a_file_for_another_pair_is_replaced_and_that_is_logged(tmp_path: Path, caplog) -> None:
    path = str(tmp_path / "mine.json")
    write_section(path, "partition", PART, device=DEVICE, model=MODEL)
    with caplog.at_level(logging.WARNING, logger="greenlane.calibration"):
        write_section(path, "jct", JCT, device=DEVICE, model="other")
    assert read_section(path, "partition")[0] is None and "sections are replaced" in caplog.text
    assert json.loads(Path(path).read_text())["model"] == "other"


def test_an_old_file_at_the_path_becomes_its_section(tmp_path: Path, caplog) -> None:
    # `--out old-partition.json --what jct`: the partition calibration in it is not lost.
    path = tmp_path / "old-partition.json"
    path.write_text(json.dumps(PART))
    with caplog.at_level(logging.WARNING, logger="greenlane.calibration"):
        assert read_section(str(path), "partition") == (PART, True)
    assert "read the old partition file" in caplog.text
    write_section(str(path), "jct", JCT, device=DEVICE, model=MODEL)
    assert read_section(str(path), "partition") == (PART, False)
    assert read_section(str(path), "jct") == (JCT, False)
    # An old file of the same model is simply replaced.
    old_jct = tmp_path / "old-jct.json"
    old_jct.write_text(json.dumps({**JCT, "coefficients": {"a_s": 9.0}}))
    write_section(str(old_jct), "jct", JCT, device=DEVICE, model=MODEL)
    assert json.loads(old_jct.read_text())["jct"] == JCT


def test_read_section_refuses_what_is_not_a_calibration(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        read_section(str(bad), "jct")
    bad.write_text(json.dumps(PART))  # an old partition file is not a JCT calibration
    with pytest.raises(ValueError, match="nor an old greenlane-jct/1"):
        read_section(str(bad), "jct")
    bad.write_text(json.dumps({"format": "greenlane-calibration/1", "jct": [1]}))
    with pytest.raises(ValueError, match="malformed jct section"):
        read_section(str(bad), "jct")


class FakeEngine:
    """What `calibrate_device` uses of a built engine: the JCT measure (synthetic) and, when
    `green`, green-context pairs (the partition profile is the fake GPU's)."""

    def __init__(self, green: bool) -> None:
        self.device_name = DEVICE
        self.device = types.SimpleNamespace(type="cuda" if green else "cpu")
        self.max_prompt_tokens = 100_000
        self._green = object() if green else None
        self.partition = types.SimpleNamespace(
            state=lambda: types.SimpleNamespace(reason="no CUDA device")
        )

    def measure_prefill(self, uncached: int, cached: int) -> float:
        return 0.01 + 1e-5 * uncached + 1e-9 * uncached * (uncached / 2 + cached)


@pytest.fixture
def fake_partition_profile(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """`runtime.partition.gpu.profile_engine` replaced by the fake GPU's profile (same file
    handling: `calibrate_partition`)."""
    import runtime.partition.gpu as gpu_mod

    calls: list[dict] = []

    def profile_engine(engine, *, full, cache_dir=None, out_path=None, progress=None):
        calls.append({"full": full, "cache_dir": cache_dir, "out_path": out_path})
        return fake_profile(
            device=engine.device_name, cache_dir=cache_dir, out_path=out_path, progress=None
        )

    monkeypatch.setattr(gpu_mod, "profile_engine", profile_engine)
    return calls


GRID = {"uncached_tokens": (64, 512, 2048), "cached_tokens": (0, 1024), "repeats": 1}


def test_one_profiler_writes_both_sections_of_one_file(tmp_path: Path, fake_partition_profile):
    run = calibrate_device(
        FakeEngine(green=True), model=MODEL, cache_dir=str(tmp_path), grid=GRID, progress=None
    )
    path = calibration_file_path(str(tmp_path), DEVICE, MODEL)
    assert run.paths == [path] and run.partition_skipped is None
    assert fake_partition_profile == [{"full": True, "cache_dir": str(tmp_path), "out_path": None}]
    assert [p.name for p in tmp_path.iterdir()] == [Path(path).name]
    jct = JCTModel.load(path, device=DEVICE, model=MODEL)
    assert jct.coefficients == pytest.approx(run.jct.coefficients)
    part = load_partition_calibration(path, device=DEVICE, total_sms=TOTAL, model=MODEL)
    assert part.parameters == run.partition.parameters
    # The start-up choices read the same file.
    assert cal_mod.resolve_calibration(path, None, "cpu", MODEL)[0] == path
    choice = choose_partition_calibration(
        explicit_path=None,
        cache_dir=str(tmp_path),
        device=DEVICE,
        total_sms=TOTAL,
        model=MODEL,
        mode="auto",
    )
    assert choice.action == "cached" and choice.path == path
    # --what jct re-profiles only its section; the partition one is kept.
    again = calibrate_device(
        FakeEngine(green=True),
        model=MODEL,
        what="jct",
        cache_dir=str(tmp_path),
        grid=GRID,
        progress=None,
    )
    assert again.partition is None and len(fake_partition_profile) == 1
    assert read_section(path, "partition")[0] == run.partition.to_dict()


def test_one_profiler_out_path_and_a_separate_partition_folder(
    tmp_path: Path, fake_partition_profile
) -> None:
    out = str(tmp_path / "here.json")
    run = calibrate_device(
        FakeEngine(green=True), model=MODEL, out_path=out, grid=GRID, progress=None
    )
    assert run.paths == [out]
    assert read_section(out, "jct")[0] and read_section(out, "partition")[0]
    # --partition-calibration-dir: the partition section goes to that folder's file.
    run = calibrate_device(
        FakeEngine(green=True),
        model=MODEL,
        cache_dir=str(tmp_path / "a"),
        partition_cache_dir=str(tmp_path / "b"),
        grid=GRID,
        progress=None,
    )
    name = one_calibration_filename(DEVICE, MODEL)
    assert run.paths == [str(tmp_path / "a" / name), str(tmp_path / "b" / name)]


def test_one_profiler_without_green_contexts(tmp_path: Path, fake_partition_profile) -> None:
    run = calibrate_device(
        FakeEngine(green=False), model=MODEL, cache_dir=str(tmp_path), grid=GRID, progress=None
    )
    path = calibration_file_path(str(tmp_path), DEVICE, MODEL)
    assert run.paths == [path] and run.partition is None and not fake_partition_profile
    assert run.partition_skipped and "no CUDA device" in run.partition_skipped
    assert read_section(path, "partition")[0] is None
    with pytest.raises(ValueError, match="unavailable: no CUDA device"):
        calibrate_device(FakeEngine(green=False), model=MODEL, what="partition", progress=None)
    with pytest.raises(ValueError, match="what must be"):
        calibrate_device(FakeEngine(green=False), model=MODEL, what="both", progress=None)
