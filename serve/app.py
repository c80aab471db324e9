"""The OpenAI-compatible HTTP API (docs/serving.md) on FastAPI, over one ServingState.

    GET  /health                 liveness and engine counters
    GET  /v1/models              the one served model and what it supports
    GET  /metrics                Prometheus text format (serve/metrics.py)
    POST /v1/completions         prompt (text or token ids) -> text; stream: server-sent events
    POST /v1/chat/completions    messages through the artifact's chat template -> assistant message

Every refusal is a JSON error in OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}`` (serve/errors.py): malformed JSON or fields 400 (text that is not valid UTF-8
included), an unknown model 404, a prompt longer than the KV capacity 400
(``context_length_exceeded``), a body past ``--max-body-bytes`` 413 (``request_too_large``,
serve/limits.py), an unknown route 404 and a wrong method 405, a full queue 503. Unexpected
failures are 500 with the same shape; nothing a client sends can crash the server. Extensions (vLLM-style): a
request may ask for ``return_token_ids`` (token ids in each choice), ``skip_special_tokens``
(default true, as ``loopcast generate``), ``ignore_eos``, ``top_k``/``min_p``/``repetition_penalty``,
``chat_template_kwargs`` (chat: extra template variables) and the generation options of
serve/request_fields.py (``speculative``, ``num_draft_tokens``, ``min_ngram``, ``max_ngram``;
an option the engine does not serve is a 400 naming it); a response's ``loopcast`` field says
which speculation served it (or why none) and its draft counts.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from loopcast.ort_runtime.batching.engine import CapacityError
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from loopcast.serve.errors import error_response as _error
from loopcast.serve.errors import install_http_errors
from loopcast.serve.limits import DEFAULT_MAX_BODY_BYTES, BodyTooLarge, lone_surrogate_at, off_loop, read_body
from loopcast.serve.metrics import CONTENT_TYPE, ServerMetrics
from loopcast.serve.request_fields import GenerationFields
from loopcast.serve.state import ServingState, TextResult
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loopcast.errors import LoopcastError, RequestError

# uvicorn's own logger: the server's lines go where its start, access and shutdown lines go.
log = logging.getLogger("uvicorn.error")


class _Common(GenerationFields):
    model_config = ConfigDict(
        extra="ignore"
    )  # unknown OpenAI fields (user, logit_bias=None, ...) are ignored

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # extension (vLLM): 0 = off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)  # not supported: only the default
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False  # extension (vLLM): generate max_tokens whatever comes
    # extensions: the generation options of serve/request_fields.py (speculative, num_draft_tokens, ...)

    def sampling(self) -> SamplingParams | None:
        if self.temperature == 0:
            return None
        return SamplingParams(
            self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty, self.seed
        )

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise RequestError("stop strings must be non-empty")
        return stops


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = Field(default=False, le=False)
    logprobs: int | None = Field(default=None, le=0)
    suffix: None = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise RequestError("one prompt per request (n=1); send several requests for several prompts")
            p = p[0]
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = Field(default=False, le=False)
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): extra template variables


def _parameter(exc: RequestError) -> str | None:
    """The request field an error is about: its ``parameter``, else the ``NAME`` of a leading
    ``NAME must`` or ``NAME and OTHER must`` (GenerationConfig's forms)."""
    match = re.match(r"([a-z_][a-z0-9_]*)(?: and [a-z_][a-z0-9_]*)? must ", str(exc))
    return exc.parameter or (match.group(1) if match else None)


def create_app(
    state: ServingState, *, close_on_shutdown: bool = True, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    """The app over ``state``; on shutdown it drains the engine unless someone else owns it (Ray).
    Request bodies past ``max_body_bytes`` are refused (413, serve/limits.py)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if close_on_shutdown:
            state.close()

    app = FastAPI(title="loopcast", lifespan=lifespan)
    install_http_errors(app)
    metrics = app.state.metrics = ServerMetrics(state.engine, state.name)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(
            400, f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}", param=where or None
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        message = state.public(f"internal error: {type(exc).__name__}: {str(exc)[:300]}")
        return _error(500, message, "server_error")

    async def parse(request: Request, kind: type[BaseModel]):
        try:
            data = await read_body(request, max_body_bytes)
        except BodyTooLarge as exc:
            return _error(413, str(exc), code="request_too_large")
        except RequestError as exc:
            return _error(400, str(exc))
        body = await off_loop(_validated, data, kind)  # parsing a large body is CPU work
        if isinstance(body, JSONResponse):
            return body
        if body.model != state.name:
            return _error(
                404,
                f"the model '{body.model}' does not exist; this server serves '{state.name}'",
                param="model",
                code="model_not_found",
            )
        return body

    @app.get("/health")
    async def health():
        return state.health()

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = {"id": state.name, "object": "model", "created": state.created, "owned_by": "loopcast"}
        card["max_model_len"] = state.max_length  # vLLM's field
        return {"object": "list", "data": [{**card, "loopcast": state.capabilities()}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        if isinstance(body, JSONResponse):
            return body
        return await _respond(state, body, chat=False, route=request.url.path, metrics=metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        if isinstance(body, JSONResponse):
            return body
        return await _respond(state, body, chat=True, route=request.url.path, metrics=metrics)

    return app


def _validated(data: bytes, kind: type[BaseModel]) -> BaseModel | JSONResponse:
    """The request ``kind`` in ``data``, or the 400 that refuses it (runs off the event loop)."""
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        return _error(400, f"request body is not valid JSON ({exc})")
    if not isinstance(raw, dict):
        return _error(400, "request body must be a JSON object")
    where = lone_surrogate_at(raw)
    if where is not None:
        return _error(400, f"invalid request: {where}: not valid UTF-8 text (a lone surrogate)", param=where)
    try:
        # strict, as OpenAI's API: true is not a token id, 16.0 not a max_tokens (ints pass as floats)
        return kind.model_validate(raw, strict=True)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


async def _respond(state: ServingState, body: _Common, *, chat: bool, route: str, metrics: ServerMetrics):
    start = time.perf_counter()
    try:
        # tokenizing and rendering the chat template are CPU work: off the event loop
        if chat:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            ids = await off_loop(state.chat_ids, messages, body.chat_template_kwargs)
            max_tokens = body.max_completion_tokens or body.max_tokens
        else:
            ids = await off_loop(state.prompt_ids, body.single_prompt())
            max_tokens = body.max_tokens or 16  # OpenAI's default for completions
        max_tokens = max_tokens or state.max_length - len(ids)
        state.check_fits(ids, max_tokens)
        sampling, stops = body.sampling(), body.stops()
        config = body.generation_config(state.speculative.value)
    except RequestError as exc:
        code = "context_length_exceeded" if "context length" in str(exc) else None
        return _error(400, state.public(str(exc)), param=_parameter(exc), code=code)
    except LoopcastError as exc:
        return _error(400, state.public(str(exc)))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    result = TextResult(len(ids))
    kwargs = dict(
        sampling=sampling,
        stop=stops,
        skip_special_tokens=body.skip_special_tokens,
        result=result,
        ignore_eos=body.ignore_eos,
        config=config,
    )
    pieces = state.stream(ids, max_tokens, **kwargs)
    try:
        first = await anext(pieces, None)  # submission errors (a full queue) surface here, before any byte
    except CapacityError as exc:
        return _error(503, str(exc), "server_busy", code="server_busy")
    except RequestError as exc:  # the engine refused an option it does not serve
        return _error(400, state.public(str(exc)), param=_parameter(exc))
    envelope = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.name,
    }
    done = _RequestLog(route, len(ids), result, start, metrics, stream=body.stream)
    if body.stream:
        return StreamingResponse(
            _sse(envelope, first, pieces, result, body, chat, state, done),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    text = (first.text if first else "") + "".join([p.text async for p in pieces])
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": text}}
        if chat
        else {"index": 0, "text": text, "logprobs": None}
    )
    choice["finish_reason"] = result.finish_reason
    if body.return_token_ids:
        choice["token_ids"] = result.tokens
    usage = {
        "prompt_tokens": len(ids),
        "completion_tokens": len(result.tokens),
        "total_tokens": len(ids) + len(result.tokens),
        # prompt tokens whose KV came from the prefix cache (OpenAI's and vLLM's field)
        "prompt_tokens_details": {"cached_tokens": getattr(result.speculative, "cached_tokens", 0)},
    }
    done()
    return {**envelope, "choices": [choice], "usage": usage, "loopcast": _speculation(result)}


@dataclass
class _RequestLog:
    """One line per finished generation request, after uvicorn's access line: tokens and time;
    and the request's observations in the app's metrics."""

    route: str
    prompt_tokens: int
    result: TextResult
    start: float
    metrics: ServerMetrics
    stream: bool = False

    def __call__(self, outcome: str = "") -> None:
        completion = self.result.speculative  # the engine's Completion: its token times
        self.metrics.observe(
            self.prompt_tokens,
            list(getattr(completion, "token_times", ()))[: len(self.result.tokens)],
            self.start,
            time.perf_counter(),
            self.result.finish_reason or "abort",
            getattr(completion, "depth", None),
        )
        log.info(
            "%s: prompt %d tokens, completion %d tokens, finish %s, %.3f s%s%s",
            self.route,
            self.prompt_tokens,
            len(self.result.tokens),
            self.result.finish_reason or "-",
            time.perf_counter() - self.start,
            " (stream)" if self.stream else "",
            f" ({outcome})" if outcome else "",
        )


def _speculation(result: TextResult) -> dict:
    """Which speculation served the request (or why none), its draft counts and, where the
    engine reports them, its depth stats (exit histogram, mean loops, core passes per token)."""
    c = result.speculative
    return {
        "speculative": getattr(c, "speculative", "none"),
        "proposed": getattr(c, "proposed", 0),
        "accepted": getattr(c, "accepted", 0),
        **getattr(c, "depth", {}),
    }


async def _sse(
    envelope: dict,
    first,
    pieces,
    result: TextResult,
    body: _Common,
    chat: bool,
    state: ServingState,
    done: _RequestLog,
):
    """OpenAI's stream: one ``data: {chunk}`` per text piece, a last chunk with the finish reason,
    then ``data: [DONE]``. A client that disconnects closes this generator, which cancels."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
        if chat:
            delta = (
                {"role": "assistant", "content": ""}
                if role
                else ({"content": text} if text is not None else {})
            )
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if finish is not None and body.return_token_ids:
            choice["token_ids"] = result.tokens
        return f"data: {json.dumps({**envelope, 'object': kind, 'choices': [choice]})}\n\n"

    try:
        if chat:
            yield chunk(None, None, role=True)
        if first is not None:
            yield chunk(first.text, None)
        async for piece in pieces:
            yield chunk(piece.text, None)
        yield chunk(None if chat else "", result.finish_reason or "stop")
        yield "data: [DONE]\n\n"
    except Exception as exc:  # mid-stream failure: the status is sent already; say so in the stream
        log.exception("%s failed mid-stream", done.route)
        message = state.public(str(exc)[:300])
        yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
    finally:
        await pieces.aclose()
        done()
