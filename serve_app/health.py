"""`/health` as a Serve application of its own, beside the main one (`route_prefix="/health"`).

A probe must answer at peak. On the ingress it waited behind the parsing of every request that
had arrived before it: 2.2 s at 1,000 requests sent at once to the default app on 2 cores, 5 s
at 5,000, through HAProxy or straight to the replica's port alike. Here it has a process and an
event loop of its own and reads only the status board (replicas/status_board.py), which says all
it needs: whether the server is stopping, whether an ingress is running (an ingress's reads of the
board are its heartbeat), and whether each model it serves has a replica whose engine loop is
alive and stepping. HAProxy (and Serve's own proxy) route by longest prefix, so `/health` comes
here and everything else to the ingress."""

from __future__ import annotations

import contextlib
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from ray import serve
from ray.serve import Application

from replicas.status_board import BoardReader
from serve_app.errors import APIError

HEALTH_ROUTE = "/health"

def health_app_name(app_name: str) -> str:
    return f"{app_name}-health"


@serve.deployment(
    # probes never wait on each other; a replica of its own needs no CPU reserved (it answers
    # from memory), so it fits beside a model on a full node
    max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
class Health:
    """A plain ASGI-request deployment: one route, no FastAPI (which cannot route the bare
    prefix: the request for /health arrives with an empty path under its root path)."""

    def __init__(self, app_name: str) -> None:
        self.board = BoardReader(app_name)
        with contextlib.suppress(RuntimeError):  # no running loop outside Serve
            self.board.start()

    async def __call__(self, request: Request) -> Response:
        """200 when an ingress is running and every model it serves has a replica whose engine
        loop is alive and not wedged, as their last reports (a few seconds old at most) say;
        503 with the reason otherwise, and while the server is stopping."""
        if request.url.path.rstrip("/") != HEALTH_ROUTE:
            return APIError(f"no route {request.url.path}", 404).response()
        if request.method not in ("GET", "HEAD"):
            return APIError(f"{HEALTH_ROUTE} takes GET", 405).response()
        self.board.start()
        why = self.board.why_unhealthy()
        if why is not None:
            return APIError(why, 503).response()
        return Response(status_code=200)


def build_health_app(app_name: str) -> Application:
    return Health.bind(app_name)


def health_builder(args: dict[str, Any]) -> Application:
    """The entry `serve run serve_config.yaml` uses: `args: {app_name: <the main app's name>}`."""
    return build_health_app(str(args.get("app_name", "shardserve")))
