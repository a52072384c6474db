"""Serve a fake vendor's ASGI app over real HTTP on 127.0.0.1, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

__all__ = ["serve_in_thread"]


@contextmanager
def serve_in_thread(app: FastAPI, name: str) -> Iterator[str]:
    """Serve ``app`` for the duration of the block; yields its base URL.

    The socket is bound before uvicorn starts and handed over, so there is no window in which another
    process can take the port between "find a free port" and "listen on it". Requests abandoned by a
    timed-out client may still be sleeping server-side at the end: shutdown does not wait long for them.
    """
    # IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP,
    # and an accepted socket inherits this one's protocol. Without it every answer on a kept-alive
    # connection (headers and body written apart) waited ~40 ms for the client's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
