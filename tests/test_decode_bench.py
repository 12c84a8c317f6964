"""`bench.decode`'s prefill check against a live (fake-engine) server: with `--batches ""` it
runs no decode, and `--prefill-repeats N` keeps N cold readings and the median one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from server_thread import fake_server, running_server


def test_prefill_check_alone_keeps_every_reading_and_the_median(
    tmp_path: Path, monkeypatch
) -> None:
    from bench import decode
    from runtime.model.presets import get_preset

    # The fake engine's vocabulary is 300 ids: the prompt's ids must come from it.
    tiny = dataclasses.replace(get_preset("tiny"), vocab_size=300)
    monkeypatch.setattr(decode, "get_preset", lambda _name: tiny)

    out = tmp_path / "d.json"
    with fake_server() as srv:
        rc = decode.main(
            [
                "--url", srv.url, "--shape", "tiny", "--batches", "", "--copy-gbs", "1",
                "--prefill-check", "48", "--prefill-repeats", "3", "--out", str(out),
            ]
        )  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["points"] == []
    checks = res["prefill_checks"]
    assert len(checks) == 3 and all(c["num_tokens"] == 48 and c["e2e_s"] > 0 for c in checks)
    assert res["prefill_check"] == sorted(checks, key=lambda c: c["e2e_s"])[1]


def test_gpu_decode_script_parses() -> None:
    import subprocess

    root = Path(__file__).resolve().parents[1]
    subprocess.run(["bash", "-n", str(root / "bench/gpu_decode.sh")], check=True)


def test_prefill_check_reads_the_engines_steps_for_the_prompt(tmp_path: Path) -> None:
    """Against the real engine (random:tiny, CPU): each cold reading carries the engine's steps
    that ran it, and their prefill tokens add up to the prompt (the cache is reset first)."""
    from bench import decode

    out = tmp_path / "d.json"
    with running_server(model="random:tiny", max_num_seqs=4, admin_token=None) as srv:
        rc = decode.main(
            [
                "--url", srv.url, "--shape", "tiny", "--batches", "", "--copy-gbs", "1",
                "--prefill-check", "300", "--prefill-repeats", "2", "--out", str(out),
            ]
        )  # fmt: skip
    assert rc == 0
    for check in json.loads(out.read_text())["prefill_checks"]:
        steps = check["engine_steps"]
        assert steps is not None and steps["num_steps"] >= 1
        # Exactly this prompt's tokens: none of the other reading's steps, none missing.
        assert steps["num_prefill_tokens"] == 300, steps
        assert len(steps["steps"]) == steps["num_steps"]


def test_prefill_check_lengths_in_order_with_the_servers_profile(tmp_path: Path) -> None:
    """Several lengths, each `--prefill-repeats` times in order; with `--prefill-profile-steps`
    each reading carries the server's profile of its steps (kernels or, on the CPU, ops, and
    the host's own time by op); the headline reading is the first length's median."""
    from bench import decode

    out = tmp_path / "d.json"
    with running_server(model="random:tiny", max_num_seqs=4, admin_token=None) as srv:
        rc = decode.main(
            [
                "--url", srv.url, "--shape", "tiny", "--batches", "", "--copy-gbs", "1",
                "--prefill-check", "200,120", "--prefill-repeats", "2",
                "--prefill-profile-steps", "1", "--out", str(out),
            ]
        )  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    checks = res["prefill_checks"]
    assert [c["num_tokens"] for c in checks] == [200, 200, 120, 120]
    assert res["prefill_check"]["num_tokens"] == 200
    for check in checks:
        prof = check["profile"]
        assert prof is not None and "error" not in prof, prof
        assert prof["num_steps"] == 1 and prof["steps_by_kind"] == {"prefill": 1}
        assert prof["host_ops"] and prof["kernel_ms"] > 0


def test_constrained_streams_report_both_groups_gaps(tmp_path: Path) -> None:
    """`--constrained-streams`: those streams run under a grammar they cannot finish, so they
    decode every token asked (no ignore_eos) beside the others, and each point reports both
    groups' gaps over the window where all decode (random:tiny, CPU)."""
    from bench import decode

    out = tmp_path / "d.json"
    with running_server(model="random:tiny", max_num_seqs=4, admin_token=None) as srv:
        rc = decode.main(
            [
                "--url", srv.url, "--shape", "tiny", "--batches", "3", "--copy-gbs", "1",
                "--context", "32", "--output-tokens", "16", "--repeats", "1",
                "--constrained-streams", "1", "--client-procs", "1", "--out", str(out),
            ]
        )  # fmt: skip
    assert rc == 0
    (point,) = json.loads(out.read_text())["points"]
    # what the grammar let through: lowercase letters only (random weights write anything)
    head = point["constrained_text_head"]
    assert len(head) >= 8 and head.isalpha() and head.islower(), head
    for group in ("constrained", "unconstrained"):
        assert point[f"itl_{group}_median_ms"] > 0, point
        assert point[f"{group}_tokens_per_s_per_stream"] > 0, point
