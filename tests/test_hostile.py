"""Hostile and careless input (issue 16): every path answers 4xx in the OpenAI error shape,
never 5xx, and nothing reaches the engine. Runs against the fake-engine server."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import MAX_MODEL_LEN, VOCAB_SIZE
from server_thread import ServerThread, fake_server

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
SCORE = "/v1/score"
ADMIN_JSON = [("PUT", "/admin/api/partition"), ("PUT", "/admin/api/policy")]
ADMIN_JSON += [("POST", "/admin/api/prefix-cache/reset")]
ADMIN_JSON += [("POST", "/admin/api/cost-model/errors/reset")]
JSON_ENDPOINTS = [("POST", CHAT), ("POST", CMPL), ("POST", SCORE), *ADMIN_JSON]
MSG = [{"role": "user", "content": "hi"}]
LONE = "\ud800"  # a lone UTF-16 surrogate: valid JSON ("\\ud800"), not text
MAX_IN_FLIGHT = 8  # max_num_seqs 4 + max_queue 4


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with fake_server(max_num_seqs=4, max_queue=4) as srv:
        yield srv


def assert_error(r: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """4xx (or `status`), the OpenAI error shape, and no exception text."""
    if status is None:
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    else:
        assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"] and "Error:" not in err["message"], err
    return err


def post_raw(http: httpx.Client, path: str, raw: bytes, method: str = "POST") -> httpx.Response:
    return http.request(method, path, content=raw, headers={"content-type": "application/json"})


# (path, body as JSON text, param named in the error or None) — JSON text, because a lone
# surrogate cannot pass through json.dumps's UTF-8 encoding in httpx.
CASES: list[tuple[str, str, str | None]] = [
    # lone surrogates in every text field
    (CHAT, json.dumps({"messages": [{"role": "user", "content": LONE}]}), "messages"),
    (
        CHAT,
        json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}),
        "messages",
    ),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "x", "name": LONE}]}), "messages"),
    (CHAT, json.dumps({"messages": MSG, "model": LONE}), "model"),
    (CHAT, json.dumps({"messages": MSG, "stop": [LONE]}), "stop"),
    (CMPL, json.dumps({"prompt": LONE}), "prompt"),
    (CMPL, json.dumps({"prompt": ["a", "b" + LONE]}), "prompt"),
    (CMPL, json.dumps({"prompt": "a", "model": LONE}), "model"),
    (CMPL, json.dumps({"prompt": "a", "stop": LONE}), "stop"),
    (SCORE, json.dumps({"query": LONE, "items": ["a"], "label_token_ids": [1]}), "query"),
    (SCORE, json.dumps({"query": "q", "items": ["a", LONE], "label_token_ids": [1]}), "items"),
    (SCORE, json.dumps({"query": "q", "items": LONE, "label_token_ids": [1]}), "items"),
    (SCORE, json.dumps({"query": "q", "items": ["a"], "labels": [LONE]}), "labels"),
    (
        SCORE,
        json.dumps({"query": "q", "items": ["a"], "label_token_ids": [1], "model": LONE}),
        "model",
    ),
    (
        SCORE,
        json.dumps({"messages": [{"role": "user", "content": LONE}], "label_token_ids": [1]}),
        "messages",
    ),
    # numbers out of range
    (CMPL, json.dumps({"prompt": "a", "seed": 2**64}), "seed"),
    (CMPL, json.dumps({"prompt": "a", "seed": -1}), "seed"),
    (CHAT, json.dumps({"messages": MSG, "seed": 10**40, "stream": True}), "seed"),
    (CMPL, json.dumps({"prompt": "a", "top_k": 10**30}), "top_k"),
    (CMPL, json.dumps({"prompt": "a", "temperature": 1e308}), "temperature"),
    (CMPL, '{"prompt": "a", "temperature": NaN}', "temperature"),
    (CMPL, '{"prompt": "a", "top_p": Infinity}', "top_p"),
    (CMPL, json.dumps({"prompt": "a", "top_p": -0.5}), "top_p"),
    (CMPL, json.dumps({"prompt": "a", "max_tokens": 10**30}), "max_tokens"),
    (CHAT, json.dumps({"messages": MSG, "max_completion_tokens": 10**30}), "max_tokens"),
    (CMPL, json.dumps({"prompt": "a", "logprobs": 10**20}), "logprobs"),
    (CHAT, json.dumps({"messages": MSG, "logprobs": True, "top_logprobs": -1}), "top_logprobs"),
    (CMPL, json.dumps({"prompt": "a", "n": 10**6}), "n"),
    (CMPL, json.dumps({"prompt": "a", "presence_penalty": 1e9}), "presence_penalty"),
    # token ids must be JSON integers in the vocabulary
    (CMPL, json.dumps({"prompt": [[False]]}), "prompt"),
    (CMPL, json.dumps({"prompt": [True, 5]}), "prompt"),
    (CMPL, json.dumps({"prompt": [1.5]}), "prompt"),
    (CMPL, json.dumps({"prompt": [[1, 2**70]]}), "prompt"),
    (SCORE, json.dumps({"query": [False], "items": ["a"], "label_token_ids": [1]}), "query"),
    (
        SCORE,
        json.dumps({"query": "q", "items": ["a"], "label_token_ids": [True]}),
        "label_token_ids",
    ),
    (
        SCORE,
        json.dumps({"query": "q", "items": ["a"], "label_token_ids": [2**63]}),
        "label_token_ids",
    ),
    # counts checked before tokenising: a call that can never fit is a 400, not a 429
    (CMPL, json.dumps({"prompt": ["a"] * (MAX_IN_FLIGHT + 1), "max_tokens": 1}), "prompt"),
    (CMPL, json.dumps({"prompt": [[1]] * (MAX_IN_FLIGHT + 1), "max_tokens": 1}), "prompt"),
    (
        SCORE,
        json.dumps({"query": "q", "items": ["a"] * (MAX_IN_FLIGHT + 1), "label_token_ids": [1]}),
        "items",
    ),
    (
        SCORE,
        json.dumps({"query": "q", "items": ["a"], "label_token_ids": [1] * (VOCAB_SIZE + 1)}),
        "label_token_ids",
    ),
    (
        SCORE,
        json.dumps({"query": "q", "items": ["a"], "labels": ["a"] * (VOCAB_SIZE + 1)}),
        "labels",
    ),
    (CHAT, json.dumps({"messages": MSG * (MAX_MODEL_LEN + 1), "max_tokens": 1}), "messages"),
    (CMPL, json.dumps({"prompt": "a", "stop": ["x"] * 17}), "stop"),
    (CMPL, json.dumps({"prompt": "a", "stop": "x" * 257}), "stop"),
    # wrong shapes
    (CMPL, json.dumps({"prompt": {"a": 1}}), "prompt"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": {"x": 1}}]}), "messages"),
]


@pytest.mark.parametrize(("path", "raw", "param"), CASES)
def test_hostile_field_is_a_400(
    http: httpx.Client, server: ServerThread, path: str, raw: str, param: str | None
) -> None:
    num_added = len(server.added())
    err = assert_error(post_raw(http, path, raw.encode()), 400)
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err
    assert len(server.added()) == num_added  # validated before admission


@pytest.mark.parametrize(("method", "path"), JSON_ENDPOINTS)
@pytest.mark.parametrize("where", ["root", "field"])
def test_deeply_nested_json_is_a_400(
    http: httpx.Client, method: str, path: str, where: str
) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    raw = deep if where == "root" else '{"messages": ' + deep + ', "policy": ' + deep + "}"
    assert_error(post_raw(http, path, raw.encode(), method), 400)


@pytest.mark.parametrize(("method", "path"), JSON_ENDPOINTS)
@pytest.mark.parametrize(
    "raw", [b"\xff\xfe{}", b'{"policy": "\xc3"}', b"{" * 5, b"[]", b"null", b'"x"', b"1e999999"]
)
def test_malformed_json_is_a_400(http: httpx.Client, method: str, path: str, raw: bytes) -> None:
    assert_error(post_raw(http, path, raw, method), 400)


def test_lone_surrogate_in_admin_body(http: httpx.Client) -> None:
    r = post_raw(http, "/admin/api/policy", json.dumps({"policy": LONE}).encode(), "PUT")
    assert_error(r, 400)


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_body_is_a_413_at_once(http: httpx.Client, chunked: bool) -> None:
    cap = 4 << 20  # the fake engine's max_model_len is small: the 4 MiB floor applies
    raw = b'{"prompt": "' + b"a" * (cap + 10) + b'"}'
    content: Any = raw
    if chunked:
        content = iter([raw[i : i + 65536] for i in range(0, len(raw), 65536)])
    r = http.post(CMPL, content=content, headers={"content-type": "application/json"})
    err = assert_error(r, 413)
    assert err["code"] == "request_too_large" and str(cap) in err["message"]
    # Just under the cap is parsed (and refused for its length, by the context check).
    ok = b'{"prompt": "' + b"a" * (cap - 100) + b'", "max_tokens": 1}'
    assert (
        http.post(CMPL, content=ok, headers={"content-type": "application/json"}).status_code == 400
    )


def test_max_body_bytes_option() -> None:
    with fake_server(max_body_bytes=1000) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.post(CMPL, json={"prompt": "a" * 900, "max_tokens": 1}).status_code != 413
        assert_error(c.post(CMPL, json={"prompt": "a" * 1000, "max_tokens": 1}), 413)


def test_unexpected_error_is_a_500_without_its_text(
    http: httpx.Client,
    server: ServerThread,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internals /etc/passwd")

    monkeypatch.setattr(server.engine, "stats", broken)  # a bug, as the app sees it
    caplog.set_level("ERROR", logger="greenlane.app")
    r = http.get("/admin/api/state")
    assert r.status_code == 500
    err = r.json()["error"]
    assert "secret" not in err["message"] and "RuntimeError" not in err["message"]
    request_id = err["message"].split("request ")[1].split(";")[0]
    assert any(request_id in rec.getMessage() for rec in caplog.records)


def test_host_guard_on_a_loopback_server(http: httpx.Client) -> None:
    # DNS rebinding: the attacker's page resolves its own name to 127.0.0.1; the Host header
    # still names it.
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.nip.io"):
        err = assert_error(http.get("/v1/models", headers={"Host": host}), 403)
        assert err["code"] == "host_not_allowed"
        assert_error(
            http.put("/admin/api/policy", json={"policy": "fcfs"}, headers={"Host": host}), 403
        )
    for host in (
        "localhost",
        "localhost:8000",
        "app.localhost",
        "127.0.0.1:1",
        "[::1]:8000",
        "10.1.2.3",
    ):
        assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_option() -> None:
    with (
        fake_server(allowed_hosts="gpu-box.lan, other") as srv,
        httpx.Client(base_url=srv.url) as c,
    ):
        assert c.get("/v1/models", headers={"Host": "gpu-box.lan:80"}).status_code == 200
        assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 403


def test_admin_changes_refuse_cross_site_requests(http: httpx.Client, server: ServerThread) -> None:
    before = server.engine.stats()["policy"]
    body = json.dumps({"policy": "fcfs"}).encode()
    # CSRF: a page may POST text/plain (or a form) cross-site without a preflight.
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": ctype} if ctype else {}
        assert_error(http.put("/admin/api/policy", content=body, headers=headers), 415)
        assert_error(http.post("/admin/api/prefix-cache/reset", content=b"", headers=headers), 415)
        reset = "/admin/api/cost-model/errors/reset"
        assert_error(http.post(reset, content=b"", headers=headers), 415)
    for origin in ("https://evil.example", "null", "http://127.0.0.1.nip.io:8000"):
        r = http.put("/admin/api/policy", json={"policy": "fcfs"}, headers={"Origin": origin})
        assert_error(r, 403)
    assert server.engine.stats()["policy"] == before
    same_site = {"Origin": server.url}
    assert (
        http.put("/admin/api/policy", json={"policy": "fcfs"}, headers=same_site).status_code == 200
    )
    # A CPU server has no partition cost model: its error-log reset is a 409 that says so.
    err = assert_error(http.post("/admin/api/cost-model/errors/reset", json={}), 409)
    assert "no partition cost model" in err["message"]


def test_admin_token_guards_reads_and_docs() -> None:
    with fake_server(admin_token="tok", api_key="key") as srv, httpx.Client(base_url=srv.url) as c:
        for path in ("/admin/api/state", "/admin/api/events", "/metrics", "/docs", "/openapi.json"):
            assert_error(c.get(path), 401)
            assert_error(c.get(path, headers={"Authorization": "Bearer key"}), 401)
        auth = {"Authorization": "Bearer tok"}
        for path in ("/admin/api/state", "/metrics", "/docs", "/openapi.json"):
            assert c.get(path, headers=auth).status_code == 200, path
        assert c.get("/health").status_code == 200  # probes stay open
        assert_error(c.get("/v1/models"), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer key"}).status_code == 200


def test_admin_event_streams_are_capped() -> None:
    with (
        fake_server(admin_max_event_streams=2) as srv,
        httpx.Client(base_url=srv.url, timeout=10) as c,
    ):
        with c.stream("GET", "/admin/api/events"), c.stream("GET", "/admin/api/events"):
            r = c.get("/admin/api/events")
            err = assert_error(r, 429)
            assert "Retry-After" in r.headers and "2" in err["message"]
        # Closed streams give their slots back.
        for _ in range(50):
            if srv.app.state.admin_event_streams == 0:
                break
            import time

            time.sleep(0.05)
        with c.stream("GET", "/admin/api/events") as r:
            assert r.status_code == 200


def test_keys_from_files(tmp_path: Any) -> None:
    (tmp_path / "key").write_text("file-key\n")
    (tmp_path / "tok").write_text("file-tok\n")
    with fake_server(
        api_key_file=str(tmp_path / "key"), admin_token_file=str(tmp_path / "tok")
    ) as srv:
        with httpx.Client(base_url=srv.url) as c:
            assert (
                c.get("/v1/models", headers={"Authorization": "Bearer file-key"}).status_code == 200
            )
            assert_error(c.get("/v1/models", headers={"Authorization": "Bearer file-ke"}), 401)
            assert (
                c.get("/metrics", headers={"Authorization": "Bearer file-tok"}).status_code == 200
            )


def test_raw_socket_garbage_never_kills_the_server(
    server: ServerThread, http: httpx.Client
) -> None:
    for raw in (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99999999999\r\n\r\n{",
        b"\x00\x01\x02 garbage\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(raw)
            sock.settimeout(5)
            try:
                reply = sock.recv(4096)
            except OSError:
                reply = b""
        assert not reply.startswith(b"HTTP/1.1 5"), reply[:200]
    assert http.get("/health").status_code == 200


def test_healthy_after_the_battery(http: httpx.Client, server: ServerThread) -> None:
    assert http.get("/health").status_code == 200
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert server.app.state.client.num_in_flight == 0


def test_api_takes_json_bodies_only(http: httpx.Client, server: ServerThread) -> None:
    # A cross-site page can POST text/plain without a preflight: it must not run a request.
    num_added = len(server.added())
    raw = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        assert_error(http.post(CMPL, content=raw, headers={"content-type": ctype}), 400)
    assert len(server.added()) == num_added
