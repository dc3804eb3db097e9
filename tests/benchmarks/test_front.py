"""benchmarks/front.py runs and reports both paths for each row count."""

from __future__ import annotations

import pytest

from benchmarks import front


def test_reports_the_channel_and_the_per_call_path(capsys: pytest.CaptureFixture[str]) -> None:
    front.main(["--rows", "1,4", "--steps", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [
        ["1", "channel"], ["1", "per-call"], ["4", "channel"], ["4", "per-call"]]
    assert all(float(line.split()[2]) > 0 for line in lines[1:])
