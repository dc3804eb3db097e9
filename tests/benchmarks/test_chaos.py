"""`bench chaos`: its report from what the clients saw around each event, and its bounds."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.chaos import Event, parse_actions, parse_bounds, summarize
from benchmarks.soak import Outcome

BOUNDS = {"kill": 5.0, "stop": 25.0}


def _ok(start: float, end: float) -> Outcome:
    return Outcome(start, end, 200, done=True)


def _failed(start: float, end: float, status: int = 503, error: str = "restarting") -> Outcome:
    return Outcome(start, end, status, error)


def test_a_run_that_kept_its_bounds_passes() -> None:
    outcomes = [_ok(0, 4), _failed(8, 10.2), _failed(9, 10.1), _failed(10.5, 10.6),
                _ok(11, 19), _ok(12, 20)]
    report = summarize(outcomes, [Event(10.0, "kill", 42)], [(1.0, 200), (11.0, 503)], BOUNDS,
                       90.0, 60.0)
    assert report["failures"] == []
    event = report["events"][0]
    assert (event["in_flight"], event["in_flight_failed"]) == (2, 2)
    assert event["last_end_s"] == pytest.approx(0.2)
    assert event["first_success_s"] == pytest.approx(9.0)  # the request started at 11 s
    assert report["statuses"] == {"200": 3, "503": 3}
    assert report["health_not_200"] == 1


def test_each_broken_promise_is_a_failure() -> None:
    outcomes = [_ok(0, 40),  # in flight at the kill, ended 30 s after it
                _failed(12, 13, 500, "Internal Server Error"),
                Outcome(14, 134, 200, exception="ReadTimeout('')")]
    report = summarize(outcomes, [Event(10.0, "kill", 42), Event(20.0, "stop", 43)],
                       [(1.0, 200), (2.0, "ConnectTimeout('')")], BOUNDS, 30.0, 200.0)
    failures = "\n".join(report["failures"])
    assert "ended 30.0 s after it (bound 5 s)" in failures
    assert "no request succeeded after the kill at 10 s" in failures
    assert "5xx other than 503" in failures
    assert "raised in the client" in failures
    assert "/health did not answer 1 times" in failures
    # and the stop at 20 s: a request in flight 114 s after it, and no success after it
    assert len(report["failures"]) == 7


def test_bounds_and_actions_parse_and_unknown_actions_are_refused() -> None:
    assert parse_bounds("kill=5,stop=25") == BOUNDS
    assert parse_actions("kill, stop") == ["kill", "stop"]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bounds("term=5")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_actions("kill,term")
