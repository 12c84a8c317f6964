"""JCT calibration end to end on the real engine (random:tiny, CPU): profile -> fit -> the one
calibration file keyed by device and model (its `jct` section; a CPU has no partition section)
-> a new engine (through the app) loads it, reports it as its JCT source and exports the
prediction error in /metrics. Also: which file a start-up picks (the one file, else an old
`jct-*.json`), explicit files of either format."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import httpx
import pytest
from server_thread import running_server

from app.cli import _calibrating_factory, main
from app.settings import Settings
from policies.jct import JCTModel, calibration_filename, one_calibration_filename
from runtime import calibrate as calibrate_mod
from runtime.calibrate import calibrate_engine, resolve_calibration, write_section
from runtime.config import EngineConfig

pytest.importorskip("runtime.engine")
from runtime.engine import Engine  # noqa: E402

MODEL = "random:tiny"
SMALL_GRID = {"uncached_tokens": (16, 64, 256), "cached_tokens": (0, 256), "repeats": 1}


def _engine(**kw: object) -> Engine:
    return Engine(
        EngineConfig(model=MODEL, device="cpu", cpu_kv_cache_gb=0.05, **kw), lambda _o: None
    )


def test_calibrate_real_engine_writes_keyed_file(tmp_path: Path) -> None:
    engine = _engine()
    lines: list[str] = []
    jct, path = calibrate_engine(
        engine, model=MODEL, out_dir=str(tmp_path), progress=lines.append, **SMALL_GRID
    )
    engine.shutdown()
    assert path == str(tmp_path / one_calibration_filename("cpu", MODEL))
    whole = json.loads(Path(path).read_text())
    assert whole["format"] == "greenlane-calibration/1" and "partition" not in whole
    assert (whole["device"], whole["model"]) == ("cpu", MODEL)
    data = whole["jct"]
    assert (data["format"], data["device"], data["model"]) == ("greenlane-jct/1", "cpu", MODEL)
    assert len(data["samples"]) == 6 and all(s["seconds"] > 0 for s in data["samples"])
    assert jct.source == f"calibration:{path}"
    # Measured, not the default: more tokens are predicted to cost more, and not the H100 model.
    assert jct.predict_s(256) > jct.predict_s(16) > 0
    assert jct.coefficients != JCTModel().coefficients
    # One progress line per point, each with an ETA; then the fit and the file.
    points = [ln for ln in lines if re.match(r"\[calibrate \d/6\]", ln)]
    assert len(points) == 6 and all("ETA" in ln for ln in points)
    assert any(ln.startswith("[calibrate] wrote the jct section of") for ln in lines)


def test_resolve_calibration_order_old_files(tmp_path: Path) -> None:
    # Old single-model files (jct-<device>--<model>.json) are still found and loaded.
    path, why = resolve_calibration(None, str(tmp_path), "cpu", MODEL)
    assert path is None and "using the fallback" in why
    cached = tmp_path / calibration_filename("cpu", MODEL)
    JCTModel(device="cpu", model=MODEL).save(str(cached))
    # A file for another model or device is not picked.
    JCTModel(device="cpu", model="other").save(str(tmp_path / calibration_filename("cpu", "other")))
    assert resolve_calibration(None, str(tmp_path), "cpu", "random:tiny-qwen2")[0] is None
    path, why = resolve_calibration(None, str(tmp_path), "cpu", MODEL)
    assert path == str(cached) and "cached calibration" in why and "old greenlane-jct/1" in why
    explicit = tmp_path / "mine.json"
    JCTModel(device="cpu", model="x").save(str(explicit))
    path, why = resolve_calibration(str(explicit), str(tmp_path), "cpu", MODEL)
    assert path == str(explicit) and "explicit" in why
    with pytest.raises(FileNotFoundError):
        resolve_calibration(str(tmp_path / "missing.json"), str(tmp_path), "cpu", MODEL)
    # The app's settings use the same resolution.
    s = Settings(model=MODEL, device="cpu", calibration_dir=str(tmp_path))
    assert s.to_engine_config().jct_calibration == str(cached)
    assert s.to_engine_config(resolve_calibration=False).jct_calibration is None


def test_resolve_calibration_prefers_the_one_file_with_a_jct_section(tmp_path: Path) -> None:
    old = tmp_path / calibration_filename("cpu", MODEL)
    JCTModel(0.5, 1e-3, 0.0, device="cpu", model=MODEL).save(str(old))
    one = tmp_path / one_calibration_filename("cpu", MODEL)
    # Only a partition section (no CPU has one, but a file may): the old JCT file is used.
    write_section(str(one), "partition", {"format": "x"}, device="cpu", model=MODEL)
    assert resolve_calibration(None, str(tmp_path), "cpu", MODEL)[0] == str(old)
    new = JCTModel(0.25, 2e-3, 0.0, device="cpu", model=MODEL)
    write_section(str(one), "jct", new.to_dict(), device="cpu", model=MODEL)
    path, why = resolve_calibration(None, str(tmp_path), "cpu", MODEL)
    assert path == str(one) and "cached calibration" in why and "old" not in why.split(",")[0]
    assert JCTModel.load(path).coefficients == new.coefficients
    # Explicit: the one file, or an old file, whichever the option names.
    path, why = resolve_calibration(str(one), None, "cpu", MODEL)
    assert path == str(one) and "jct section" in why
    path, why = resolve_calibration(str(old), None, "cpu", MODEL)
    assert path == str(old) and "old greenlane-jct/1 file" in why
    # An explicit one file without a jct section is refused, not silently replaced.
    other = tmp_path / "partition-only.json"
    write_section(str(other), "partition", {"format": "x"}, device="cpu", model=MODEL)
    with pytest.raises(ValueError, match="no jct section"):
        resolve_calibration(str(other), None, "cpu", MODEL)
    # An engine started with either explicit file loads it.
    for f, want in ((one, new), (old, JCTModel(0.5, 1e-3, 0.0))):
        engine = _engine(jct_calibration=str(f))
        try:
            assert engine.jct_model.source == f"calibration:{f}"
            assert engine.jct_model.coefficients == pytest.approx(want.coefficients)
        finally:
            engine.shutdown()


def test_cli_calibrate_then_serve_loads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "calibrate",
            "--model",
            MODEL,
            "--device",
            "cpu",
            "--cpu-kv-cache-gb",
            "0.05",
            "--calibration-dir",
            str(tmp_path),
            "--uncached-tokens",
            "16,64,256",
            "--cached-tokens",
            "0,256",
            "--repeats",
            "1",
            "--log-level",
            "warning",
        ]
    )
    assert rc == 0
    # One file, with the JCT section; a CPU has no green contexts, and the CLI says so.
    path = str(tmp_path / one_calibration_filename("cpu", MODEL))
    out = capsys.readouterr()
    assert out.out.strip() == path
    assert "partition section not profiled" in out.err and "no CUDA device" in out.err
    assert [p.name for p in tmp_path.iterdir()] == [Path(path).name]
    whole = json.loads(Path(path).read_text())
    assert "jct" in whole and "partition" not in whole
    # A new server for the same device and model picks the file up without being told.
    with (
        running_server(
            model=MODEL, device="cpu", cpu_kv_cache_gb=0.05, calibration_dir=str(tmp_path)
        ) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as http,
    ):
        assert srv.engine.stats()["jct_source"] == f"calibration:{path}"
        for i in range(3):  # prefill-only steps: they feed the online error metric
            r = http.post("/v1/completions", json={"prompt": f"hello {i} " * 20, "max_tokens": 1})
            assert r.status_code == 200, r.text
        srv.stats_after()  # the engine's snapshot now includes those steps
        time.sleep(0.5)  # and a heartbeat has brought it to the front end
        text = http.get("/metrics").text
    assert "# HELP greenlane_jct_prediction_mape JCT model prediction error" in text
    (value,) = re.findall(r"^greenlane_jct_prediction_mape (\S+)$", text, re.M)
    assert math.isfinite(float(value)) and float(value) >= 0.0
    assert f'greenlane_jct_model_info{{source="calibration:{path}"}} 1.0' in text
    (steps,) = re.findall(r"^greenlane_jct_observed_steps_total (\S+)$", text, re.M)
    assert float(steps) >= 1


def test_serve_calibrate_updates_the_shared_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `serve --calibrate`: the engine built for serving is profiled before it starts, and its
    # policies (which hold the engine's JCT model object) see the calibrated model.
    monkeypatch.setattr(calibrate_mod, "CPU_UNCACHED_TOKENS", SMALL_GRID["uncached_tokens"])
    monkeypatch.setattr(calibrate_mod, "CPU_CACHED_TOKENS", SMALL_GRID["cached_tokens"])
    monkeypatch.setattr(calibrate_mod, "CPU_REPEATS", 1)
    settings = Settings(model=MODEL, device="cpu", calibration_dir=str(tmp_path), calibrate=True)
    make = _calibrating_factory(settings, lambda c, s: Engine(c, s))
    engine = make(settings.to_engine_config(), lambda _o: None)
    try:
        path = str(tmp_path / one_calibration_filename("cpu", MODEL))
        assert engine.jct_model.source == f"calibration:{path}"
        assert engine.policy.jct_model is engine.jct_model
        assert engine.jct_model.coefficients == JCTModel.load(path).coefficients
    finally:
        engine.shutdown()


def test_no_calibration_is_the_labelled_fallback(tmp_path: Path) -> None:
    s = Settings(model=MODEL, device="cpu", calibration_dir=str(tmp_path))
    engine = Engine(s.to_engine_config(), lambda _o: None)
    try:
        # On the CPU the documented 8B default (CUDA engines derive it from the model's
        # shape: tests/test_engine.py).
        assert engine.stats()["jct_source"] == "fallback-default"
        assert not engine.jct_model.calibrated
    finally:
        engine.shutdown()
