"""The server tests' helpers: a real uvicorn server on a free loopback port (cli/serve.py)."""

from loopcast.serve.launch import background_server as running_server  # noqa: F401
