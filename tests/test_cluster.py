"""Greenlane on Ray Serve (app/cluster/): a local Ray cluster with 2 replicas of random:tiny,
started once for this session. Every endpoint through the ingress; one user's requests on one
replica (prefix-cache hits counted there); SSE relayed unbuffered; overload is 429; a killed
replica is replaced while the service keeps answering (this test runs last: it kills one)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_thread import free_port, parse_sse_strict

ray = pytest.importorskip("ray", reason="needs the `cluster` extra (ray[serve])")
from ray import serve  # noqa: E402

from app.cluster.cli import connect_ray, deploy  # noqa: E402
from app.cluster.config import ClusterConfig  # noqa: E402

pytestmark = pytest.mark.cluster

APP = "greenlane-test"
STATS_PERIOD_S = 0.25
ADMIN_TOKEN = "cluster-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# Small admission limits so that overload is reachable: each replica admits 4 + 4 requests,
# and 4 more may wait in the ingress for a free replica.
REPLICA_SETTINGS = {
    "model": "random:tiny",
    "max_num_seqs": 4,
    "max_queue": 4,
    "cpu_kv_cache_gb": 0.25,
    "log_level": "warning",
    # The ingress's admin and read endpoints need it, like a replica's.
    "admin_token": ADMIN_TOKEN,
}


# Module scope: Ray starts once for all the cluster tests (they all live here) and stops as soon
# as they are done, so its processes do not sit on CI's 2 cores during the rest of the suite.
@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    # 2 replicas + room for a replacement while the killed one is still being cleaned up.
    connect_ray(None, num_cpus=3)
    config = ClusterConfig(
        replica_settings=REPLICA_SETTINGS,
        app_name=APP,
        num_replicas=2,
        replica_num_cpus=1.0,
        routing_stats_period_s=STATS_PERIOD_S,
        max_queued_requests=4,
        health_check_period_s=1.0,
        health_check_timeout_s=10.0,
    )
    url = deploy(config, "127.0.0.1", free_port(), blocking_timeout_s=300)
    try:
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def replicas(url: str) -> dict[str, dict[str, Any]]:
    return httpx.get(url + "/cluster/replicas", headers=ADMIN, timeout=30).json()["replicas"]


def wait_reports_newer_than(url: str, t: float, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reps = replicas(url)
        if reps and all(r["reported_at_s"] > t for r in reps.values()):
            return reps
        time.sleep(STATS_PERIOD_S)
    raise TimeoutError("replica reports did not refresh")


def score_body(query: list[int], item: int, **extra: Any) -> dict[str, Any]:
    return {"query": query, "items": [[item, item + 1]], "label_token_ids": [11, 12], **extra}


# ----------------------------------------------------------------------------- config files


def test_app_builder_for_serve_config_files() -> None:
    """deploy/rayservice.yaml's entry: ClusterConfig fields + replica Settings; bad options fail
    the deploy with the reason (no cluster needed to check)."""
    import yaml

    from app.cluster.deployment import app_builder

    manifest = yaml.safe_load(open("deploy/rayservice.yaml"))
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (application,) = serve_config["applications"]
    assert application["import_path"] == "app.cluster.deployment:app_builder"
    assert application["args"]["replica_num_gpus"] == 1
    built = app_builder({**application["args"], "replica_settings": {"model": "random:tiny"}})
    assert type(built).__name__ == "Application"
    with pytest.raises(ValueError, match="block_size"):
        app_builder({"replica_settings": {"model": "random:tiny", "block_size": 3}})
    with pytest.raises(ValueError, match="router"):
        app_builder({"router": "random"})


def test_secret_files_resolve_once_for_the_replicas(tmp_path: Any) -> None:
    """--api-key-file / --admin-token-file: the secrets are read once, and the replicas get
    them without the file (a replica given both refused to start: the deploy failed)."""
    from app.cluster.cli import build_parser, config_from_args
    from app.cluster.deployment import app_builder
    from app.settings import Settings

    key, token = tmp_path / "key", tmp_path / "token"
    key.write_text("k-123\n")
    token.write_text("t-456\n")
    files = ["--api-key-file", str(key), "--admin-token-file", str(token)]
    args = build_parser().parse_args(["--model", "random:tiny", "--replica-num-gpus", "0", *files])
    config = config_from_args(args)
    replica = Settings(**config.replica_settings)  # what each replica builds
    assert (replica.api_key, replica.admin_token) == ("k-123", "t-456")
    assert config.replica_admission_limit() >= 1
    built = app_builder({"replica_settings": {"model": "random:tiny", "api_key_file": str(key)}})
    assert type(built).__name__ == "Application"


# ----------------------------------------------------------------------------- endpoints


def test_every_endpoint_through_the_ingress(cluster: str) -> None:
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["random:tiny"]

    chat = client.chat.completions.create(
        model="random:tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model="random:tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    comp = client.completions.create(model="random:tiny", prompt="Hello", max_tokens=4)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 4
    comp_stream = list(
        client.completions.create(model="random:tiny", prompt="Hello", max_tokens=4, stream=True)
    )
    assert sum(1 for c in comp_stream if c.choices and c.choices[0].text) >= 1

    # Raw SSE, parsed strictly: the ingress relays the replica's events byte for byte.
    resp = httpx.post(
        cluster + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True},
        timeout=60,
    )
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    payloads = parse_sse_strict(resp.content)
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"

    score = httpx.post(
        cluster + "/v1/score",
        json=score_body(list(range(20, 60)), 7, apply_softmax=True),
        timeout=60,
    )
    assert score.status_code == 200, score.text
    probs = score.json()["scores"][0]
    assert len(probs) == 2 and abs(sum(probs) - 1.0) < 1e-4
    assert score.headers["x-greenlane-replica"] in replicas(cluster)

    assert httpx.get(cluster + "/health", timeout=30).json() == {"status": "ok"}
    metrics = httpx.get(cluster + "/metrics", headers=ADMIN, timeout=30)
    assert metrics.status_code == 200
    assert "greenlane_cluster_replicas 2.0" in metrics.text
    assert 'greenlane_cluster_requests_total{endpoint="/v1/score",status="200"}' in metrics.text
    assert metrics.text.count("greenlane_cluster_replica_queue_depth{replica=") == 2


def test_errors_keep_the_openai_shape(cluster: str) -> None:
    bad = httpx.post(cluster + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    garbage = httpx.post(cluster + "/v1/completions", content=b"{nope", timeout=30)
    assert garbage.status_code == 400
    assert garbage.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(cluster + "/v1/nothing", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    # A body over the replicas' cap (4 MiB for random:tiny) is the replicas' 413, answered at
    # the ingress (it was a 503: the replica's server closed the upload early).
    huge = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    for content in (huge, iter([huge[: 1 << 20], huge[1 << 20 :]])):  # declared, chunked
        big = httpx.post(cluster + "/v1/completions", content=content, timeout=60)
        assert big.status_code == 413, big.text
        assert big.json()["error"]["code"] == "request_too_large"
        assert big.json()["error"]["type"] == "invalid_request_error"
    # The request id the client sent comes back once (it came twice: "id, id").
    r = httpx.post(
        cluster + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"X-Request-Id": "client-id-1"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["client-id-1"]
    assert r.json()["id"] == "client-id-1"


def test_the_single_servers_other_endpoints_and_admin_token(cluster: str) -> None:
    """/v1/models/{id}, the tokenizer endpoints and /version are forwarded (they were 404s);
    the ingress's admin and read endpoints need the admin token, like a replica's."""
    model = httpx.get(cluster + "/v1/models/random:tiny", timeout=30)
    assert model.status_code == 200 and model.json()["id"] == "random:tiny"
    nope = httpx.get(cluster + "/v1/models/nope", timeout=30)
    assert nope.status_code == 404 and nope.json()["error"]["code"] == "model_not_found"
    tok = httpx.post(cluster + "/tokenize", json={"prompt": "hello world"}, timeout=30)
    assert tok.status_code == 200, tok.text
    detok = httpx.post(cluster + "/detokenize", json={"tokens": tok.json()["tokens"]}, timeout=30)
    assert detok.status_code == 200 and "hello" in detok.json()["prompt"]
    assert httpx.get(cluster + "/tokenizer_info", timeout=30).status_code == 200
    assert "version" in httpx.get(cluster + "/version", timeout=30).json()

    for method, path in [
        ("GET", "/metrics"),
        ("GET", "/cluster/replicas"),
        ("GET", "/admin/api/state"),
        ("POST", "/admin/api/prefix-cache/reset"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, cluster + path, headers=headers, timeout=30)
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.request(method, cluster + path, headers=ADMIN, timeout=60).status_code == 200


def test_sse_is_relayed_chunk_by_chunk(cluster: str) -> None:
    """Events reach the client as the engine makes them, not in one buffered piece."""
    arrivals: list[float] = []
    body = {
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", cluster + "/v1/chat/completions", json=body, timeout=60) as resp:
        raw = b""
        for chunk in resp.iter_raw():
            arrivals.append(time.monotonic())
            raw += chunk
    payloads = parse_sse_strict(raw)
    # role chunk, up to 48 content chunks (a sampled token that ends inside a UTF-8 character
    # shows with the next one), finish, [DONE]
    assert 24 + 3 <= len(payloads) <= 48 + 3 and payloads[-1] == "[DONE]"
    assert len(arrivals) >= 10
    assert arrivals[-1] - arrivals[0] > 0.02  # spread over the decode, not all at the end


# ----------------------------------------------------------------------------- affinity


def test_one_users_requests_land_on_one_replica_and_hit_its_cache(cluster: str) -> None:
    httpx.post(
        cluster + "/admin/api/prefix-cache/reset", headers=ADMIN, timeout=60
    ).raise_for_status()
    profile = list(range(300, 300 + 320))  # 20 KV blocks of 16: the key window is 256 ids
    # Hit counters are cumulative: earlier tests' traffic is subtracted.
    start = {
        k: v["prefix_hit_tokens"] for k, v in wait_reports_newer_than(cluster, time.time()).items()
    }
    before = time.time()
    homes = set()
    for i in range(6):
        r = httpx.post(cluster + "/v1/score", json=score_body(profile, 40 + 2 * i), timeout=60)
        assert r.status_code == 200, r.text
        homes.add(r.headers["x-greenlane-replica"])
    assert len(homes) == 1
    (home,) = homes
    # Replica reports carry the engine's stats snapshot, published at a fixed rate: a fresh
    # report may still miss the last requests' hits, so wait for them (or time out).
    want = 5 * 320 - 5 * 16
    deadline = time.monotonic() + 15
    while True:
        reps = wait_reports_newer_than(cluster, time.time())
        got = (reps.get(home) or {}).get("prefix_hit_tokens", 0) - start.get(home, 0)
        if got >= want or time.monotonic() > deadline:
            break
    assert set(reps) >= {home} and len(reps) == 2
    other = next(r for r in reps if r != home)
    # The profile was computed once, on the home; the other five requests found it cached.
    assert reps[home]["prefix_hit_tokens"] - start.get(home, 0) >= want
    assert reps[other]["prefix_hit_tokens"] - start.get(other, 0) == 0
    assert before < reps[home]["reported_at_s"]

    # An explicit user sticks too, even with prompts too short to have a prefix key.
    users = {}
    for name in ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"):
        seen = set()
        for i in range(3):
            r = httpx.post(
                cluster + "/v1/completions",
                json={"prompt": f"hi {i}", "max_tokens": 1, "user": name},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-greenlane-replica"])
        assert len(seen) == 1, name
        users[name] = seen.pop()
    assert len(set(users.values())) == 2  # 8 users over 2 replicas: both get some (p = 1 - 2^-7)


def test_prefix_cache_reset_reaches_every_replica(cluster: str) -> None:
    r = httpx.post(cluster + "/admin/api/prefix-cache/reset", headers=ADMIN, timeout=60)
    assert r.status_code == 200
    reply = r.json()
    assert len(reply["replicas"]) == 2
    reps = replicas(cluster)
    assert all(s["reset_epoch_done"] >= reply["reset_epoch"] for s in reps.values())


# ----------------------------------------------------------------------------- overload


def test_overload_is_429_with_retry_after(cluster: str) -> None:
    """2 replicas x (4 running + 4 queued) + 4 waiting in the ingress = 20 admitted; 40 long
    requests at once: the rest are turned away at once, not left hanging. The admitted ones
    still running after 20 s are not waited for: their clients leave, which aborts them on
    their replicas (idle again ~0.6 s later, where they would run on for tens of seconds)."""

    async def burst() -> tuple[list[tuple[float, httpx.Response]], int]:
        # Long (~seconds each), so the admitted ones still hold their places when the last of
        # the 40 arrives on a loaded 2-core CI machine (with 128 tokens 36 of 40 were once
        # admitted). Waiting for all of them to finish took over 120 s there once.
        body = {"prompt": "Once upon a time", "max_tokens": 1024, "ignore_eos": True}
        started = time.monotonic()

        async def one(client: httpx.AsyncClient) -> tuple[float, httpx.Response]:
            r = await client.post(cluster + "/v1/completions", json=body)
            return time.monotonic() - started, r

        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(one(client)) for _ in range(40)]
            done, pending = await asyncio.wait(tasks, timeout=20.0)
            for t in pending:
                t.cancel()  # the client leaves
            await asyncio.gather(*pending, return_exceptions=True)
            return [t.result() for t in done], len(pending)

    answered, num_left = asyncio.run(burst())
    codes = [r.status_code for _, r in answered]
    assert set(codes) <= {200, 429}, codes
    # Of the 20 places, some free up while the 40 still arrive on a loaded 2-core machine, so
    # more than 20 may be admitted (31 once, with 9 turned away): the count of 429s is a floor
    # with room for that, not 20.
    assert codes.count(429) >= 5 and codes.count(200) + num_left >= 8, (codes, num_left)
    for at_s, r in answered:
        if r.status_code == 429:
            assert at_s < 15.0  # turned away at once, not after a wait for a place
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
    # The tests after this one start from idle replicas (reports made after the clients left).
    left_s = time.time()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        reps = replicas(cluster)
        if all(r["reported_at_s"] > left_s and r["queue_depth"] == 0 for r in reps.values()):
            break
        time.sleep(STATS_PERIOD_S)
    else:
        raise AssertionError(f"replicas still busy: {reps}")


# ----------------------------------------------------------------------------- faults (last)


def _replica_actor(replica_id: str) -> Any:
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].endswith(f"#GreenlaneReplica#{replica_id}"):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise LookupError(replica_id)


def test_killed_replica_is_replaced_and_the_service_answers_throughout(cluster: str) -> None:
    # Find the victim: the home of user "victim", so a request can be put in flight on it.
    probe = httpx.post(
        cluster + "/v1/completions",
        json={"prompt": "x", "max_tokens": 1, "user": "victim"},
        timeout=60,
    )
    victim = probe.headers["x-greenlane-replica"]
    survivor = next(r for r in replicas(cluster) if r != victim)

    # Background load for the whole test: short requests from many users, one at a time.
    stop = threading.Event()
    results: list[tuple[int, str]] = []

    def load() -> None:
        i = 0
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                i += 1
                r = client.post(
                    cluster + "/v1/completions",
                    json={"prompt": "hello", "max_tokens": 2, "user": f"u{i % 7}"},
                )
                results.append((r.status_code, r.text[:200]))

    loader = threading.Thread(target=load, daemon=True)
    loader.start()

    # A non-streamed request and a stream, both in flight on the victim when it dies.
    slow = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "user": "victim"}
    outcome: dict[str, Any] = {}

    def non_streamed() -> None:
        r = httpx.post(cluster + "/v1/completions", json=slow, timeout=120)
        outcome["plain"] = (r.status_code, r.headers.get("x-greenlane-replica"), r.json())

    stream_started = threading.Event()

    def streamed() -> None:
        raw = b""
        with httpx.stream(
            "POST", cluster + "/v1/completions", json={**slow, "stream": True}, timeout=120
        ) as resp:
            for chunk in resp.iter_raw():
                raw += chunk
                stream_started.set()
        outcome["stream"] = raw

    threads = [threading.Thread(target=non_streamed), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    assert stream_started.wait(60)
    time.sleep(0.2)
    ray.kill(_replica_actor(victim), no_restart=True)
    for t in threads:
        t.join(120)

    # The non-streamed request had sent nothing back: it was retried on the other replica.
    status, served_by, body = outcome["plain"]
    assert status == 200 and served_by == survivor
    assert body["usage"]["completion_tokens"] == 400
    # The stream had started: it ends with a clear error event, then [DONE].
    payloads = parse_sse_strict(outcome["stream"])
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "replica_failed"

    # Ray replaces the replica; the service answers all along.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        reps = replicas(cluster)
        if len(reps) == 2 and victim not in reps:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"replica not replaced: {replicas(cluster)}")
    new = next(r for r in reps if r != survivor)
    r = httpx.post(
        cluster + "/v1/completions",
        json={"prompt": "x", "max_tokens": 1, "user": "victim"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-greenlane-replica"] in (new, survivor)
    stop.set()
    loader.join(120)
    assert len(results) >= 5
    failed = [res for res in results if res[0] != 200]
    assert not failed, failed[:3]


def _child_pids(pid: int) -> list[int]:
    """A process's children, from Linux's /proc (CI's machines are Linux)."""
    found: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def test_a_replica_whose_engine_died_is_passed_over_until_replaced(cluster: str) -> None:
    """The engine core of a replica dies; the replica's process lives on (answering 503) until
    Ray's health check replaces it, seconds later. Requests routed to it in that window are
    sent again, once, to another replica (they were answered 503: its user's home is there).
    Last: the replacement starts after this test (the fixture's teardown does not wait)."""
    import signal

    body = {"prompt": "x", "max_tokens": 1, "user": "engine-victim"}
    victim = httpx.post(cluster + "/v1/completions", json=body, timeout=60).headers[
        "x-greenlane-replica"
    ]
    pid = ray.get(_replica_actor(victim).__ray_call__.remote(lambda _: os.getpid()))
    cores = [c for c in _child_pids(pid) if b"spawn_main" in _cmdline(c)]
    assert cores
    for c in cores:
        os.kill(c, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # its report says so within a stats period or two
        rep = replicas(cluster).get(victim)
        if rep is None or not rep["alive"]:
            break
        time.sleep(0.05)
    answers = []
    until = time.monotonic() + 1.5
    while time.monotonic() < until:
        r = httpx.post(cluster + "/v1/completions", json=body, timeout=60)
        answers.append((r.status_code, r.headers.get("x-greenlane-replica"), r.text[:160]))
    assert len(answers) >= 3
    assert all(status == 200 for status, _, _ in answers), answers
    assert all(served_by != victim for _, served_by, _ in answers), answers
