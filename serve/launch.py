"""`loopcast serve`: the OpenAI-compatible server on uvicorn, or as a Ray Serve application.

The server dependencies live in the ``serve`` extra; without them the command says which extra
to install (one ``error:`` line, exit 2) instead of a traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass

from loopcast.serve.state import ServeOptions

from loopcast.errors import LoopcastError, RequestError


@dataclass(frozen=True)
class RayOptions:
    num_replicas: int | None = 1  # None: autoscaling between min and max replicas
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float = 8.0  # autoscaling: per-replica load it aims for
    max_ongoing_requests: int = 64  # per replica, before Ray queues at the proxy
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    address: str | None = None  # an existing Ray cluster (default: start a local one)


def require_extra(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise LoopcastError(
            f"loopcast serve needs {', '.join(missing)}: install the serve extra "
            "(pip install 'loopcast[serve]')"
        )


def serve_uvicorn(artifact: str, options: ServeOptions, host: str, port: int, log=print) -> None:
    """Load, start the engine, serve until SIGINT/SIGTERM; then stop taking connections, let
    running requests finish (the app's shutdown drains the engine) and exit."""
    require_extra("fastapi", "uvicorn", "prometheus_client")
    import uvicorn
    from loopcast.serve.app import create_app
    from loopcast.serve.state import open_serving

    sock = listening_socket(host, port)  # before loading: a taken port fails at once, one line
    try:
        state = open_serving(artifact, options)
    except BaseException:
        sock.close()
        raise
    log(f"serving '{state.name}' from {artifact}: {state.mode}; http://{host}:{port}/v1")
    config = uvicorn.Config(
        # uvicorn's conventional logging: start-up, one access line per request, shutdown
        create_app(state, max_body_bytes=options.max_body_bytes),
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=30,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        state.close(5.0)


def listening_socket(host: str, port: int):
    """A socket bound to ``host:port`` for uvicorn to serve on, or a RequestError naming ``port``
    (in use, not permitted, no such address): the failure is the CLI's one ``error:`` line, not
    uvicorn's log lines and exit status. Binding here, not in uvicorn, leaves no window between
    the check and the bind."""
    import socket

    if not 1 <= port <= 65535:
        raise RequestError(f"port must be in 1..65535, got {port}", parameter="port")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise RequestError(f"--host {host!r}: not an address to listen on ({exc})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise RequestError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc})", parameter="port"
        ) from None
    sock.set_inheritable(True)
    return sock


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def background_server(state, port: int | None = None, start_timeout: float = 30.0):
    """The app over ``state`` on uvicorn in a thread, on 127.0.0.1 only (tests, tools/bench/loadgen.py);
    yields its URL once /health answers; on exit stops it as SIGTERM would (drain, then close)."""
    require_extra("fastapi", "uvicorn", "httpx", "prometheus_client")
    import threading
    import time

    import httpx
    import uvicorn
    from loopcast.serve.app import create_app

    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise LoopcastError(f"the server on {url} did not start in {start_timeout:.0f} s")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(start_timeout)


def serve_ray(
    artifact: str,
    options: ServeOptions,
    ray_options: RayOptions,
    host: str,
    port: int,
    log=print,
    block: bool = True,
):
    """Run the same app as a Ray Serve application (docs/serving.md); blocks until Ctrl-C."""
    require_extra("fastapi", "ray", "prometheus_client")
    import time

    import ray
    from loopcast.serve.ray_app import build_deployment
    from ray import serve

    ray.init(
        address=ray_options.address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False
    )
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_deployment(artifact, options, ray_options), name="loopcast", route_prefix="/")
    replicas = (
        f"{ray_options.num_replicas} replica(s)"
        if ray_options.num_replicas is not None
        else f"autoscaling {ray_options.min_replicas}..{ray_options.max_replicas} replicas"
    )
    log(f"serving {artifact} on Ray Serve ({replicas}); http://{host}:{port}/v1")
    if not block:
        return
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
