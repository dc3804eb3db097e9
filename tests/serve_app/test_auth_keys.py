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


def test_per_key_and_per_model_admission() -> None:
    from serve_app.admission import Admission
    from serve_app.config import AppConfig
    from serve_app.errors import APIError
    config = AppConfig.model_validate({"models": [{"max_num_seqs": 1, "max_waiting": 1,
                                                   "max_queued_requests": 1}],
                                       "max_requests_per_key": 2})
    adm = Admission(config)
    model = config.models[0].name
    assert adm.limits[model] == 3
    a, b = adm.admit(model, "k1"), adm.admit(model, "k1")
    with pytest.raises(APIError) as exc:
        adm.admit(model, "k1")
    assert exc.value.status == 429 and exc.value.retry_after == 1
    assert exc.value.response().headers["retry-after"] == "1"
    c = adm.admit(model, "k2")
    with pytest.raises(APIError) as exc:  # the model's capacity: 3
        adm.admit(model, "k3")
    assert exc.value.status == 503 and "overloaded" in exc.value.message
    with pytest.raises(APIError) as exc:  # full before the body is read
        adm.check_room()
    assert exc.value.status == 503 and adm.rejected[model, "overloaded"] == 2
    a.release()
    a.release()  # idempotent
    adm.check_room()
    d = adm.admit(model, "k1")
    assert adm.in_flight[model] == 3 and adm.rejected[model, "per_key_limit"] == 1
    for t in (b, c, d):
        t.release()
    assert adm.in_flight[model] == 0 and not adm.by_key
