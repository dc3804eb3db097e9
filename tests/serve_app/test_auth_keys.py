"""APIKeys and the key file, without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_app.auth import APIKeys, read_key_file


def test_any_configured_key_is_accepted_and_nothing_else() -> None:
    keys = APIKeys(["alpha", "beta-longer-key", "alpha"])
    assert keys and keys.accepts("alpha") and keys.accepts("beta-longer-key")
    for wrong in ("", "alph", "alpha ", "ALPHA", "beta", "alphabeta-longer-key", "\udcff"):
        assert not keys.accepts(wrong)
    assert not APIKeys([])


def test_key_file_skips_blank_lines_and_comments(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# ops keys\n  k1  \n\nk2\n")
    assert read_key_file(str(f)) == ["k1", "k2"]
    with pytest.raises(ValueError, match="cannot read the API key file"):
        read_key_file(str(tmp_path / "missing"))


def test_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from serve_app.config import AppConfig
    monkeypatch.setenv("SHARDSERVE_API_KEY", "a, b,,c")
    monkeypatch.setenv("SHARDSERVE_API_KEY_FILE", "/run/secrets/keys")
    config = AppConfig()
    assert config.api_keys == ["a", "b", "c"] and config.api_key_file == "/run/secrets/keys"
