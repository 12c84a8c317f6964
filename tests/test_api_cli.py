"""Settings and CLI: env vs flags, --help, and graceful shutdown on SIGTERM (subprocess)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_thread import free_port, parse_sse_strict

from app.cli import build_parser, main
from app.settings import Settings, engine_field_names
from runtime.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent


def _settings_from_cli(argv: list[str]) -> Settings:
    args = build_parser().parse_args(["serve", *argv])
    return Settings(**{k: v for k, v in vars(args).items() if k != "command"})


def test_env_then_cli_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GREENLANE_PORT", "9001")
    monkeypatch.setenv("GREENLANE_PREFILL_POLICY", "spf")
    monkeypatch.setenv("GREENLANE_MAX_MODEL_LEN", "512")
    monkeypatch.setenv("GREENLANE_HYBRID_PREFILL", "false")
    s = _settings_from_cli([])
    assert (s.port, s.prefill_policy, s.max_model_len, s.hybrid_prefill) == (
        9001,
        "spf",
        512,
        False,
    )
    s = _settings_from_cli(
        [
            "--port",
            "9002",
            "--prefill-policy",
            "fcfs",
            "--max-model-len",
            "none",
            "--hybrid-prefill",
            "true",
            "--api-key",
            "k",
        ]
    )
    assert (s.port, s.prefill_policy, s.max_model_len, s.hybrid_prefill, s.api_key) == (
        9002,
        "fcfs",
        None,
        True,
        "k",
    )
    cfg = s.to_engine_config()
    assert (
        isinstance(cfg, EngineConfig) and cfg.prefill_policy == "fcfs" and cfg.max_model_len is None
    )


def test_options_the_engine_sizes_take_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--prefill-chunk-tokens auto` (and the environment's) is the default, the engine's
    sizing; a number is kept; `auto` is no word for an option where unset means off."""
    assert _settings_from_cli(["--prefill-chunk-tokens", "auto"]).prefill_chunk_tokens is None
    assert _settings_from_cli(["--prefill-chunk-tokens", "8192"]).prefill_chunk_tokens == 8192
    assert _settings_from_cli(["--num-kv-blocks", "AUTO"]).num_kv_blocks is None
    monkeypatch.setenv("GREENLANE_PREFILL_WARM_UP_TOKENS", "auto")
    monkeypatch.setenv("GREENLANE_PREFILL_CHUNK_TOKENS", "4096")
    s = Settings()
    assert (s.prefill_warm_up_tokens, s.prefill_chunk_tokens) == (None, 4096)
    with pytest.raises(SystemExit):
        _settings_from_cli(["--ttft-slo-ms", "auto"])
    with pytest.raises(SystemExit):
        _settings_from_cli(["--prefill-chunk-tokens", "big"])


def test_every_engine_option_is_a_setting_and_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    import dataclasses

    assert set(engine_field_names()) == {f.name for f in dataclasses.fields(EngineConfig)}
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in out, name
        assert "GREENLANE_" + name.upper() in out, name


def test_invalid_option_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--block-size", "3"]) == 2
    assert "block_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--port", "not-a-port"])


def test_a_variable_that_names_no_option_is_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.settings import unknown_env_options

    # A removed option (forty-fifth session) and a typo; real options and the two non-option
    # variables the server reads are not reported.
    env = {
        "GREENLANE_OVERLAP_MAX_STEP_MS": "100",
        "GREENLANE_PREFIL_POLICY": "fcfs",
        "GREENLANE_PREFILL_POLICY": "fcfs",
        "GREENLANE_PORT": "9001",
        "GREENLANE_CACHE_DIR": "/tmp",
        "GREENLANE_PROFILE_DIR": "/tmp",
        "PATH": "/bin",
    }
    assert unknown_env_options(env) == ["GREENLANE_OVERLAP_MAX_STEP_MS", "GREENLANE_PREFIL_POLICY"]
    monkeypatch.setenv("GREENLANE_OVERLAP_MAX_STEP_MS", "100")
    assert main(["serve", "--block-size", "3"]) == 2  # stops before loading anything
    err = capsys.readouterr().err
    assert "GREENLANE_OVERLAP_MAX_STEP_MS names no option: ignored" in err
    assert "block_size" in err


_SERVER_SCRIPT = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
from fake_engine import FakeEngine
from app.cli import serve
from app.settings import Settings
sys.exit(serve(Settings(port={port}, shutdown_grace_s={grace}, log_level="warning"{extra}),
               engine_factory=FakeEngine))
"""


def _start(grace_s: float, extra: str = "") -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    script = _SERVER_SCRIPT.format(
        root=str(ROOT), tests=str(ROOT / "tests"), port=port, grace=grace_s, extra=extra
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert proc.poll() is None, "server exited during start-up"
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)


def _stream_with_sigterm(proc: subprocess.Popen[bytes], url: str, max_tokens: int) -> list[str]:
    body = {"prompt": "abc", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    raw = b""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        it = r.iter_bytes()
        raw += next(it)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        # Not admitting any more: refused connection or 503.
        try:
            status = httpx.post(
                url + "/v1/completions", json={"prompt": "a"}, timeout=5
            ).status_code
        except httpx.TransportError:
            status = 503
        assert status == 503
        for part in it:
            raw += part
    return parse_sse_strict(raw)


def test_sigterm_lets_running_requests_finish_and_exits_0() -> None:
    proc, url = _start(grace_s=10)
    try:
        payloads = _stream_with_sigterm(proc, url, max_tokens=250)  # ~0.5 s of fake decoding
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(c["choices"][0]["text"] for c in chunks)) == 250
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_sigterm_aborts_what_outlives_the_grace_period() -> None:
    proc, url = _start(grace_s=0.1)
    try:
        payloads = _stream_with_sigterm(proc, url, max_tokens=250)
        assert payloads[-1] == "[DONE]"
        err = json.loads(payloads[-2])
        assert err["error"]["code"] == "shutting_down"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def _read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (headers and its Content-Length body), however the bytes
    arrive; b"" when the server has closed the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _two_requests_on_one_connection(url: str, idle_s: float) -> bytes:
    """A GET /health, `idle_s` of silence, then a second on the same connection: what the
    server sent back for the second (b"" when it had closed the connection)."""
    host, port = url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        first = _read_response(sock)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"}"), first
        time.sleep(idle_s)
        try:
            sock.sendall(request)
            return _read_response(sock)
        except (ConnectionResetError, BrokenPipeError):
            return b""


def test_an_idle_connection_outlives_a_clients_pool_expiry() -> None:
    """Idle for 6 s, past httpx's 5-s pool expiry (and uvicorn's own 5-s default), a kept
    connection still serves the next request; with `keep_alive_s=1` the server has closed it
    (the setting is applied, not ignored)."""
    for extra, idle_s, open_after in (("", 6.0, True), (", keep_alive_s=1", 2.5, False)):
        proc, url = _start(grace_s=1, extra=extra)
        try:
            second = _two_requests_on_one_connection(url, idle_s)
            assert second.startswith(b"HTTP/1.1 200") == open_after, second
        finally:
            proc.kill()


def test_the_open_file_limit_is_raised_towards_what_the_server_wants(monkeypatch) -> None:
    """A low soft limit is raised, never past the hard one; an ample one is left alone."""
    import resource

    from app import cli

    state = {"soft": 1024, "hard": 4096}
    monkeypatch.setattr(resource, "getrlimit", lambda _k: (state["soft"], state["hard"]))

    def setrlimit(_k: int, limits: tuple[int, int]) -> None:
        state["soft"], state["hard"] = limits

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert cli.raise_open_file_limit(65536) == (1024, 4096)  # up to the hard limit
    assert state == {"soft": 4096, "hard": 4096}
    assert cli.raise_open_file_limit(65536) is None  # already at the hard limit
    state.update(soft=1024, hard=1_000_000)
    assert cli.raise_open_file_limit(65536) == (1024, 65536)
    state.update(soft=100_000)
    assert cli.raise_open_file_limit(65536) is None  # ample already: not lowered
    assert state["soft"] == 100_000
