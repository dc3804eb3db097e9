"""Inbox: the socket where the engine cores of this ingress's Ray node send its requests' rows
directly (direct channels, replicas/channel.py), so that no Ray message, and no model replica's
Python, carries tokens.

A ZeroMQ PULL socket bound to an IPC path in a directory only this user can open (mode 0700), read
by a thread of its own; each message (a list of `core_protocol.batch_row`s, the same as a Ray
channel message) reaches the event loop as one callback. The directory goes when the inbox
closes, or at the process's exit."""

from __future__ import annotations

import asyncio
import atexit
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Inbox:
    def __init__(self, on_message: Callable[[bytes], None]) -> None:
        import zmq

        self._loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._dir = tempfile.mkdtemp(prefix="shardserve-inbox-")
        self.address = f"ipc://{self._dir}/rows"
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.address)
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="inbox", daemon=True)
        self._reader.start()
        atexit.register(self.close)

    def _read(self) -> None:
        pull, loop = self._pull, self._loop
        try:
            while not self._closed.is_set():
                if pull.poll(200):
                    message = pull.recv()
                    if not loop.is_closed():
                        loop.call_soon_threadsafe(self._on_message, message)
        except Exception as exc:  # noqa: BLE001  (the socket closed under it)
            if not self._closed.is_set():
                logger.warning("inbox reader ended: %r", exc)
        finally:
            pull.close(linger=0)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._reader.join(timeout=2)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
