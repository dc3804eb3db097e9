"""The OpenAPI document declares what the routes parse themselves, and its examples are valid."""

from __future__ import annotations

import pytest

from serve_app import protocol
from serve_app.ingress import app

BODIES = {"/v1/chat/completions": protocol.ChatCompletionRequest,
          "/v1/completions": protocol.CompletionRequest,
          "/tokenize": protocol.TokenizeRequest, "/detokenize": protocol.DetokenizeRequest}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_request_bodies_and_errors_are_declared(path: str) -> None:
    document = app.openapi()
    post = document["paths"][path]["post"]
    ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    name = ref.rsplit("/", 1)[-1]
    assert name == BODIES[path].__name__
    schema = document["components"]["schemas"][name]
    for example in schema.get("examples", []):  # what the docs page shows validates
        BODIES[path].model_validate(example)
    for code in ("400", "401", "404", "429", "503"):
        assert post["responses"][code]["content"]["application/json"]["schema"]["$ref"] \
            .endswith("/ErrorResponse")
    # every reference resolves
    text = str(document)
    for ref_name in {r.split("'")[0] for r in text.split("#/components/schemas/")[1:]}:
        assert ref_name in document["components"]["schemas"], ref_name
