"""The app's OpenAPI document (`/openapi.json`, `/docs`): request bodies and error answers.

The generation routes read their bodies themselves (off the event loop, after admission: see
ingress.py), so FastAPI cannot see their request models; each route names its model here with
`body(Model)` and the models' JSON schemas join the document's components. Every route also
declares the error envelope for the statuses it can answer with, so a client generator or an API
fuzzer (tests/reliability/test_fuzz_openapi.py) knows what to expect."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"
_ERROR_SCHEMA = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}},
    }},
}
_ERRORS = {400: "Invalid request (the message names the field in `param`)",
           401: "Missing or wrong API key", 404: "No such model or route",
           429: "This API key's request limit; retry after `Retry-After` seconds",
           503: "Overloaded, queue-wait deadline passed or shutting down; retry after "
                "`Retry-After` seconds"}
_BODIES: dict[str, type[BaseModel]] = {}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": REF.format(model="ErrorResponse")}}}}


def body(model: type[BaseModel], streams: bool = False) -> dict[str, Any]:
    """`openapi_extra` for a route that parses `model` from its JSON body itself."""
    _BODIES[model.__name__] = model
    ok: dict[str, Any] = {"application/json": {"schema": {}}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": REF.format(model=model.__name__)}}}},
        "responses": {"200": {"description": "Successful Response", "content": ok},
                      **{str(code): _error(text) for code, text in _ERRORS.items()}},
    }


def install(app: FastAPI) -> None:
    """Makes `app.openapi()` add the bodies' schemas and the error envelope to components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            _, defs = models_json_schema([(m, "validation") for m in _BODIES.values()],
                                         ref_template=REF)
            schemas.update(defs.get("$defs", {}))
            schemas["ErrorResponse"] = _ERROR_SCHEMA
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
