"""Serve an ASGI app on 127.0.0.1 in a background thread, for tests that need a live endpoint.

    with serve_app(app) as base:      # "http://127.0.0.1:<free port>"
        ...
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def serve_app(app, timeout: float = 30.0) -> Iterator[str]:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="test-server")
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
        sock.close()
