"""`bench host` runs the runner's prepare and the sampler over every case it names."""

from __future__ import annotations

import argparse

from benchmarks import host


def test_every_case_is_timed() -> None:
    p = argparse.ArgumentParser()
    host.add_cli_args(p)
    out = host.run(p.parse_args(["--rows", "1,4", "--vocab", "300", "--steps", "3",
                                 "--prompts", "2", "--context", "40"]))
    assert len(out["prepare_us"]) == 4 and all(v > 0 for v in out["prepare_us"].values())
    assert len(out["sample_us"]) == 2 * len(host.SAMPLINGS)
    assert "4 rows x 300 vocab, top_p 0.9 flat" in out["sample_us"]
