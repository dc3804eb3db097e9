"""Schemathesis over the app's own /openapi.json: every operation, in its examples, coverage and
fuzzing phases (valid and invalid bodies, parameters and headers), against the real Serve app and
engine. None may answer 5xx; the server keeps serving.

The app is small on purpose (n <= 2, a 16-token context: the fuzzer's chat prompts that render
are 9-16 tokens) so a valid generation request the fuzzer makes costs at most ~16 tokens: the
generations are most of the test's time (on an AVX2-only Zen 3 box a 64-token context took 300 s
of the suite's 30 minutes, 32 took 130-160 s, 24 took 102 s and 16 takes 68 s, with as many
requests answered 200 at 24 and 16: ~310 chat and ~270 completions generations)."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from serve_app import ingress
from tests.conftest import SMALL_MODEL, shared_app

pytestmark = [pytest.mark.shared_app("fuzz"), pytest.mark.slow]

CONTEXT = 16
EXAMPLES = 15  # per operation and phase: ~1 minute for the two generation routes on 2 cores


@pytest.fixture(scope="module")
def base_url() -> str:
    return shared_app({"models": [{**SMALL_MODEL, "max_model_len": CONTEXT}], "max_n": 2},
                      http_front="haproxy")


# the document the app serves, built where the app is (schemathesis's lazy fixture loader does
# not run under pytest 9); the first test checks the server serves exactly this one
DOCUMENT = ingress.app.openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)
STATUSES: Counter[tuple[str, int]] = Counter()


def test_the_served_document_is_the_one_fuzzed(base_url: str) -> None:
    served = httpx.get(f"{base_url.removesuffix('/v1')}/openapi.json", timeout=10)
    assert served.status_code == 200
    assert served.json() == json.loads(json.dumps(DOCUMENT))
    assert "ChatCompletionRequest" in DOCUMENT["components"]["schemas"]


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case, base_url: str) -> None:
    response = case.call_and_validate(base_url=base_url.removesuffix("/v1"),
                                      checks=[not_a_server_error], timeout=60)
    STATUSES[f"{case.method} {case.path}", response.status_code] += 1


def test_still_serving_after_the_fuzzing(base_url: str) -> None:
    print(f"fuzzed: {sum(STATUSES.values())} requests; by operation and status:",
          dict(sorted(STATUSES.items())))
    # the fuzzing ran, and not only into validation: valid requests reached the engine
    for op in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert sum(n for (o, _), n in STATUSES.items() if o == op) >= EXAMPLES, STATUSES
        assert STATUSES[op, 200] >= 5, STATUSES
    root = base_url.removesuffix("/v1")
    assert httpx.get(f"{root}/health", timeout=10).status_code == 200
    r = httpx.post(f"{base_url}/chat/completions", timeout=60, json={
        "model": SMALL_MODEL["model"], "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4})
    assert r.status_code == 200, r.text
