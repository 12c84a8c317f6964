"""The replay behind `bench.activation_memory` (the GPU part needs CUDA's allocator history)."""

from __future__ import annotations

from bench.activation_memory import live_at_peak, per_token, site_of


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_site_is_the_innermost_frame_of_our_code() -> None:
    frames = [
        frame("/usr/lib/python3/site-packages/torch/functional.py", 10, "empty_like"),
        frame("/work/main/runtime/model/llama.py", 212, "forward_chunked"),
        frame("/work/main/runtime/runner.py", 122, "profile_activation_peak"),
    ]
    assert site_of(frames) == "runtime/model/llama.py:212 forward_chunked"
    assert site_of(frames[:1]).endswith("functional.py:10 empty_like")
    assert site_of([]) == "?"


def test_live_bytes_at_the_peak_by_site() -> None:
    a, b = [frame("/x/runtime/a.py", 1, "f")], [frame("/x/runtime/b.py", 2, "g")]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": a},
        {"action": "alloc", "addr": 2, "size": 50, "frames": b},
        {"action": "free_requested", "addr": 2, "size": 50},  # not yet free: still counted
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "alloc", "addr": 3, "size": 70, "frames": b},  # peak: 100 + 70 = 170
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 60, "frames": a},  # 130: below the peak
        {"action": "free_completed", "addr": 99, "size": 5},  # allocated before the trace
    ]
    peak, by_site = live_at_peak(events)
    assert peak == 170
    assert by_site == {"runtime/a.py:1 f": 100, "runtime/b.py:2 g": 70}


def test_per_token_orders_sites_by_growth() -> None:
    small = (0, {"q": 1000, "fixed": 500})
    large = (0, {"q": 3000, "fixed": 500, "new": 400})
    rows = per_token(small, large, d_tokens=100)
    assert [r["site"] for r in rows] == ["q", "new", "fixed"]
    assert rows[0]["bytes_per_token"] == 20.0 and rows[2]["bytes_per_token"] == 0.0
