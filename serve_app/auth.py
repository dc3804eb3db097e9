"""API keys: which keys the server accepts, and the FastAPI dependency every route runs.

Keys come from the config (`api_keys`, SHARDSERVE_API_KEY) and from a file of one key a line
(`api_key_file`, SHARDSERVE_API_KEY_FILE), read where the ingress runs so they never pass through
a command line or Serve's stored config. Every key is compared with `hmac.compare_digest`, and all
of them are compared every time, so neither a key's content nor which key matched shows in the
answer's timing (vLLM's CVE-2025-59425 was a plain `!=`)."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from fastapi import Request

from serve_app.errors import APIError

# probes and scrapers carry no key
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})


def read_key_file(path: str) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path!r}: {exc.strerror}") from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


class APIKeys:
    """The accepted keys, kept as sha256 digests: equal-length inputs to compare_digest, so a
    key's length does not show either."""

    def __init__(self, keys: list[str]) -> None:
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in dict.fromkeys(keys))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, given: str) -> bool:
        digest = hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()
        found = False
        for accepted in self._digests:  # no early exit: every key is compared
            found |= hmac.compare_digest(digest, accepted)
        return found


def given_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else None
    return given or request.headers.get("x-api-key")


def client_id(request: Request) -> str:
    """Who is asking, for per-client limits: the API key's digest when there is one (the key
    itself never leaves the ingress), else the first address the request came from."""
    key = getattr(request.state, "api_key", None)
    if key:
        return "key:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    forwarded = request.headers.get("x-forwarded-for", "").split(",")[0].strip()
    return "addr:" + (forwarded or (request.client.host if request.client else "unknown"))


async def require_api_key(request: Request) -> None:
    """The app-wide dependency: with keys configured, every route but the open ones needs one.
    The key is left on `request.state.api_key` for per-key limits."""
    keys: APIKeys = request.app.state.api_keys
    given = given_key(request)
    request.state.api_key = given
    if not keys or request.url.path in OPEN_PATHS:
        return
    if given is None or not keys.accepts(given):
        raise APIError("invalid or missing API key (send Authorization: Bearer <key> or "
                       "x-api-key)", 401, type_="AuthenticationError")
