"""Turning a generation request away before the application sees it: while the server is stopping,
or every model already holds as many requests as it can (`Admission.check_room`), a POST to a
generation route is answered 503 (the OpenAI envelope, `Retry-After`) by a pure ASGI layer in
front of FastAPI: no routing, no request object, no exception handling, no body read.

Under a burst almost every request ends here, so its cost bounds how fast a burst is shed on a
busy CPU. It answers before authentication too: an overloaded server says so to anyone, as a load
balancer in front of it would; everything else (the per-key limit included) stays behind auth."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from serve_app.errors import APIError

# the routes that admit generation work (the ingress's `_admit` callers)
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Shedding:
    """ASGI middleware; the app's `state.check_room` (set by the ingress) raises the refusal."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
            check_room = getattr(scope["app"].state, "check_room", None)
            if path in GENERATION_PATHS and check_room is not None:
                try:
                    check_room()
                except APIError as exc:
                    await exc.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)
