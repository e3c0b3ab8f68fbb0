"""The cluster page's window of recent requests: buckets of one step, closed steps only, old
buckets dropped, quantiles of the kept samples, and a bounded reservoir."""

from __future__ import annotations

import pytest

from kvbaton.frontend import request_window
from kvbaton.frontend.request_window import RequestWindow

pytestmark = pytest.mark.unit


def at(monkeypatch: pytest.MonkeyPatch, now: float) -> None:
    monkeypatch.setattr(request_window.time, "time", lambda: now)


def test_points_cover_closed_steps_with_rates_and_quantiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    window = RequestWindow(span_s=10.0, step_s=2.0)
    at(monkeypatch, 100.5)
    for ttft in (0.1, 0.2, 0.3, 0.4):
        window.record(200, ttft, ttft / 10)
    window.record(503, None, None)
    at(monkeypatch, 103.0)
    window.record(200, 1.0, None)  # still open at 103.9: not a point yet

    points = window.points(103.9)
    assert [p["t"] for p in points] == [92.0, 94.0, 96.0, 98.0, 100.0]
    last = points[-1]
    assert last["requests_per_s"] == 5 / 2.0
    assert last["failed_per_s"] == 1 / 2.0
    assert last["ttft_p50_s"] == 0.3 and last["ttft_p90_s"] == 0.4
    assert last["itl_p50_s"] == pytest.approx(0.03)
    assert points[0] == {
        "t": 92.0,
        "requests_per_s": 0.0,
        "failed_per_s": 0.0,
        "ttft_p50_s": None,
        "ttft_p90_s": None,
        "itl_p50_s": None,
        "itl_p90_s": None,
    }
    assert window.points(104.0)[-1]["ttft_p50_s"] == 1.0  # its step closed
    assert window.ended == 6


def test_old_buckets_are_dropped_and_samples_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    window = RequestWindow(span_s=10.0, step_s=2.0)
    for second in range(0, 100, 2):
        at(monkeypatch, float(second))
        window.record(200, 0.5, 0.01)
    assert len(window._buckets) <= 6  # the span's 5 steps and the open one
    at(monkeypatch, 200.0)
    for _ in range(10 * request_window.SAMPLES):
        window.record(200, 0.5, 0.01)
    (bucket,) = [b for i, b in window._buckets.items() if i == 100]
    assert bucket.ended == 10 * request_window.SAMPLES
    assert len(bucket.ttft.kept) == request_window.SAMPLES


def test_a_window_shorter_than_a_step_is_refused() -> None:
    with pytest.raises(ValueError, match="step"):
        RequestWindow(span_s=1.0, step_s=2.0)
