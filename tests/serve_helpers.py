"""A real uvicorn server on a free loopback port, in a background thread, for the server tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(state):
    import httpx
    import uvicorn

    from loopcast.serve_app import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not start in 30 s")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True   # what SIGTERM does: stop accepting, finish, run the app's shutdown
        thread.join(30)
