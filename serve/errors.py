"""The server's refusals, every one an OpenAI error object:
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (5xx for the server's own
failures). Routing errors too: an unknown route is a 404 ``Invalid URL (METHOD /path)`` as
OpenAI's own API answers, a wrong method a 405 with the ``Allow`` header kept. No message
carries a path of the server's file system (ServingState.public scrubs library messages)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

ROUTES = "GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions"


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status, headers=headers)


def install_http_errors(app: FastAPI) -> None:
    """Starlette's routing errors (404, 405, ...) in OpenAI's shape instead of ``{"detail": ...}``."""

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        where = f"{request.method} {request.url.path[:200]}"
        if exc.status_code == 404:
            message, code = f"Invalid URL ({where}); this server answers {ROUTES}", "not_found"
        elif exc.status_code == 405:
            message, code = (
                f"method not allowed ({where}); this server answers {ROUTES}",
                "method_not_allowed",
            )
        else:
            message, code = str(exc.detail)[:300], None
        return error_response(exc.status_code, message, code=code, headers=getattr(exc, "headers", None))
