"""The OpenAI-compatible HTTP server over any GenerationBackend.

Routes: POST /v1/chat/completions, POST /v1/completions (both streaming over SSE or not),
GET /v1/models, GET /v1/traces/{request_id} (Chrome trace JSON, with --enable-tracing),
GET /health, GET /metrics (Prometheus). Every error has the OpenAI body
{"error": {"message", "type", "param", "code"}}: bad input is a 400 (never FastAPI's 422), an
unknown model a 404 with code "model_not_found" (what OpenAI answers), a missing or wrong API
key a 401, and a BackendError its own status with a message naming the node and stage.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import uuid
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.backend import BackendError, GenerationBackend
from cluster.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from cluster.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormatter,
    describe_validation_error,
    error_body,
    now,
)
from cluster.streaming import (
    ClientGone,
    backend_error_body,
    collect,
    event_stream,
    next_delta,
    unless_disconnected,
)
from engine import RequestRejectedError, SamplingParams
from engine.prompt_embeds import PromptEmbeds
from engine.tracing import clock_ns

log = logging.getLogger(__name__)

# 499 (nginx's "client closed request") is only ever logged: nobody is there to read it.
CLIENT_CLOSED_REQUEST = 499


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | int | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type


def create_app(backend: GenerationBackend, api_key: str | None = None) -> FastAPI:
    """An app serving `backend`. With `api_key`, /v1/* needs `Authorization: Bearer <key>`;
    /health and /metrics stay open for load balancers, probes and scrapers."""
    app = FastAPI(title="pdcluster", docs_url=None, redoc_url=None)
    started = now()

    async def require_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), api_key):
            raise OpenAIError(401, "missing or incorrect API key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

    @v1.get("/models")
    async def models() -> dict:
        card = {
            "id": backend.model_name,
            "object": "model",
            "created": started,
            "owned_by": "pdcluster",
            "max_model_len": backend.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @v1.get("/traces/{request_id}")
    async def trace(request_id: str) -> JSONResponse:
        # A backend that traces keeps a `traces` store (cluster.tracing.TraceStore).
        traces = getattr(backend, "traces", None)
        found = traces.get(request_id) if traces is not None else None
        if found is None:
            why = "it is unknown or too old" if traces is not None else "tracing is off"
            message = f"no trace for request {request_id!r}: {why}"
            raise OpenAIError(404, message, param="request_id", code="trace_not_found")
        return JSONResponse(found)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival_ns = clock_ns()
        _check_common(body, backend)
        if not body.messages:
            raise OpenAIError(400, "messages must not be empty", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = backend.apply_chat_template(messages)
        except (ValueError, LookupError, TemplateError) as err:
            raise OpenAIError(400, f"could not apply the chat template: {err}") from err
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(body, body.requested_max_tokens, logprobs, len(prompt), backend)
        return await _generate(
            request, backend, body, "chat", prompt, params, arrival_ns=arrival_ns
        )

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival_ns = clock_ns()
        _check_common(body, backend)
        if body.echo:
            raise OpenAIError(400, "echo=true is not supported", param="echo")
        if body.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        prompt = _prompt_token_ids(body.prompt, backend.tokenizer)
        embeds = _prompt_embeds(body)
        params = _sampling_params(body, body.max_tokens, body.logprobs, len(prompt), backend)
        return await _generate(
            request, backend, body, "completion", prompt, params, embeds, arrival_ns=arrival_ns
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        report = await backend.health()
        return JSONResponse(report, status_code=200 if report.get("status") == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # Open like /health (scrapers carry no key); a backend without metrics answers 404.
        render = getattr(backend, "metrics_text", None)
        if render is None:
            raise OpenAIError(404, "this backend exposes no metrics", type="not_found_error")
        return Response(await render(), media_type=METRICS_CONTENT_TYPE)

    app.include_router(v1)
    _install_error_handlers(app)
    return app


def _check_common(body: ChatCompletionRequest | CompletionRequest, backend: Any) -> None:
    if body.model is not None and body.model != backend.model_name:
        raise OpenAIError(
            404,
            f"the model {body.model!r} does not exist; this server serves {backend.model_name!r}",
            param="model",
            code="model_not_found",
        )
    if body.n != 1:
        raise OpenAIError(400, f"n must be 1 (one choice per request), got {body.n}", param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) not in (None, 0):
            raise OpenAIError(400, f"{name} is not supported (only 0)", param=name)


def _prompt_token_ids(prompt: Any, tokenizer: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise OpenAIError(
                400, "batched prompts are not supported: send one prompt per request", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        # The same encoding as engine.LLM.generate, so both give the same tokens for a string.
        return tokenizer.encode(prompt)
    return list(prompt)


def _prompt_embeds(body: CompletionRequest) -> PromptEmbeds | None:
    """The extension's vectors; their width and positions are the backend's to check."""
    if body.prompt_embeds is None:
        return None
    try:
        return PromptEmbeds.of((item.position, item.embedding) for item in body.prompt_embeds)
    except RequestRejectedError as err:
        raise OpenAIError(400, str(err), param="prompt_embeds") from err


def _sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_len: int,
    backend: Any,
) -> SamplingParams:
    if max_tokens is None:
        # Unset in chat means "until the context is full", as in the OpenAI API.
        max_tokens = backend.max_model_len - prompt_len
        if max_tokens < 1:
            raise OpenAIError(
                400,
                f"the prompt ({prompt_len} tokens) fills the context of "
                f"{backend.max_model_len} tokens",
                param="messages",
            )
    elif max_tokens < 1:
        raise OpenAIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    optional = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    return SamplingParams(
        max_tokens=max_tokens,
        stop=body.stop or (),
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        **{name: value for name, value in optional.items() if value is not None},
    )


async def _generate(
    request: Request,
    backend: GenerationBackend,
    body: ChatCompletionRequest | CompletionRequest,
    kind: str,
    prompt: list[int],
    params: SamplingParams,
    prompt_embeds: PromptEmbeds | None = None,
    arrival_ns: int | None = None,
) -> Response:
    # Passed only when given, so that a backend without the extension serves the rest.
    extension = {} if prompt_embeds is None else {"prompt_embeds": prompt_embeds}
    backend.validate(prompt, params, **extension)
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    formatter = ResponseFormatter(kind, request_id, backend, body.include_usage)
    started = time.perf_counter()
    # Likewise the timeline so far, only to a backend that traces (cluster.tracing).
    if getattr(backend, "traces", None) is not None and arrival_ns is not None:
        extension["trace_events"] = [("arrival", arrival_ns), ("tokenized", clock_ns())]
    deltas = backend.generate(request_id, prompt, params, **extension)

    def log_line(outcome: str, completion_tokens: int) -> None:
        log.info(
            "%s %s prompt=%d completion=%d %s %.3fs",
            request.url.path,
            request_id,
            len(prompt),
            completion_tokens,
            outcome,
            time.perf_counter() - started,
        )

    try:
        if not body.stream:
            result = await unless_disconnected(request, collect(deltas))
            log_line(f"finish={result.finish_reason}", len(result.token_ids))
            return JSONResponse(formatter.complete(result))
        first = await unless_disconnected(request, next_delta(deltas))
    except ClientGone:
        log_line("client disconnected", 0)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException:
        await deltas.aclose()
        raise
    return event_stream(first, deltas, formatter, log_line)


def _install_error_handlers(app: FastAPI) -> None:
    def reply(request: Request, status: int, body: dict[str, Any]) -> JSONResponse:
        log.info("%s %d: %s", request.url.path, status, body["error"]["message"])
        return JSONResponse(body, status_code=status)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, err: OpenAIError) -> JSONResponse:
        return reply(request, err.status, error_body(err.message, err.type, err.param, err.code))

    @app.exception_handler(RequestRejectedError)
    async def rejected(request: Request, err: RequestRejectedError) -> JSONResponse:
        return reply(request, 400, error_body(str(err)))

    @app.exception_handler(BackendError)
    async def backend_error(request: Request, err: BackendError) -> JSONResponse:
        return reply(request, err.status, backend_error_body(err))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(err.errors())
        return reply(request, 400, error_body(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return reply(request, err.status_code, error_body(str(err.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets the usual error body.
        body = error_body(f"internal server error: {err!r}", type="server_error", code=500)
        return reply(request, 500, body)


class BackgroundServer:
    """Serve an app with uvicorn on a background thread (tests, notebooks). port=0 takes a free
    port chosen by the OS, so two servers on one host never collide."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="http-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
