"""The server tests' helpers: a real uvicorn server on a free loopback port (loopcast/cli_serve.py)."""

from loopcast.cli_serve import background_server as running_server, free_port  # noqa: F401
