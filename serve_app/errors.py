"""The OpenAI error envelope and the FastAPI handlers that render every failure as one.

`{"error": {"message", "type", "param", "code"}}`, `code` being the HTTP status. Validation failures
are 400 (never FastAPI's 422) and name the offending field in `param`."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from replicas.request import EngineError

logger = logging.getLogger(__name__)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 405: "MethodNotAllowed", 408: "TimeoutError",
          413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError", 429: "RateLimitError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_ or _TYPES.get(status, "BadRequestError")
        # seconds, sent as Retry-After (429/503): the openai SDK waits that long before retrying
        self.retry_after = retry_after

    @classmethod
    def from_exception(cls, exc: BaseException) -> "APIError":
        """Maps an error raised anywhere on the request path (incl. through a Ray hop) to one."""
        if isinstance(exc, APIError):
            return exc
        for e in (exc, getattr(exc, "cause", None), exc.__cause__):
            if isinstance(e, EngineError):
                return cls(e.message, e.status, e.param, e.type,
                           getattr(e, "retry_after", None))
            if e is not None and type(e).__name__ == "ConstraintError":
                return cls(str(getattr(e, "message", e)), 400, getattr(e, "param", None))
        logger.error("internal error", exc_info=exc)
        return cls(f"internal server error: {type(exc).__name__}", 500)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def _clean_loc(loc: tuple) -> list[str]:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # drop pydantic's union-member tags after the field name: types ("str", "list[str]",
    # "literal[...]", "function-after[...]") and model classes ("NamedToolChoice")
    clean: list[str] = []
    for p in parts:
        if clean and not p.isdigit() and ("[" in p or p[:1].isupper() or p in (
                "str", "int", "float", "bool", "dict", "list", "function-after")):
            continue
        clean.append(p)
    return clean


def _loc_to_param(loc: tuple) -> str | None:
    clean = _clean_loc(loc)
    if not clean:
        return None
    out = clean[0]
    for p in clean[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return APIError(f"the body is not valid JSON: {first.get('msg', '')}", 400)
    # A union field fails once per member; the member that got deepest into the value is the
    # one the client meant (a list of parts, not a string), so report that error.
    field = tuple(first.get("loc", ()))[:1]
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:1] == field] or [first]
    best = max(same_field, key=lambda e: len(_clean_loc(tuple(e.get("loc", ())))))
    param = _loc_to_param(tuple(best.get("loc", ())))
    msg = best.get("msg", "invalid request")
    if best.get("type") == "missing":
        msg = "this field is required"
    return APIError(f"{param}: {msg}" if param else msg, 400, param)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        return APIError.from_exception(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), exc.status_code).response()

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        return APIError.from_exception(exc).response()
