"""The server tests' helpers: a real uvicorn server on a free loopback port (serve/launch.py)."""

from loopcast.serve.launch import background_server as running_server
from loopcast.serve.launch import free_port

__all__ = ["free_port", "running_server"]
