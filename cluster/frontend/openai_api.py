"""The OpenAI-compatible HTTP server over any GenerationBackend.

Routes: POST /v1/chat/completions, POST /v1/completions (both streaming over SSE or not),
GET /v1/models, GET /v1/models/{id}, GET /v1/traces/{request_id} (Chrome trace JSON, with
--enable-tracing), GET /health, GET /metrics (Prometheus). Every error has the OpenAI body
{"error": {"message", "type", "param", "code"}}: bad input is a 400 (never FastAPI's 422, never
a 500), an unknown model a 404 with code "model_not_found" (what OpenAI answers), a missing or
wrong API key a 401, a body over the size limit a 413 (400s and 413s count as "rejected"
failures in the backend's metrics), and a BackendError its own status with a message naming
the node and stage.
Generation requests pass the admission gate (cluster.frontend.admission) first: a 503 with
Retry-After while the server drains (and /health answers 503, status "draining"), a 429 with
Retry-After when too many are in flight, and a 503 for one with no first token within the queue
timeout. Work that grows with the prompt (tokenizing, validating) runs on a worker thread, so that
the event loop keeps answering /health and the streams of other requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from cluster.control.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from cluster.deploy.config import DEFAULT_MAX_REQUEST_BYTES
from cluster.frontend.admission import Admission, AdmittedRequest
from cluster.frontend.api_errors import (
    COMMON_ERRORS,
    OpenAIError,
    count_failure,
    error_responses,
    install_error_handlers,
)
from cluster.frontend.backend import GenerationBackend, TokenDelta
from cluster.frontend.choices import (
    ChoiceRequest,
    choice_requests,
    merge_choices,
    shared_prefill_groups,
    total_usage,
)
from cluster.frontend.http_guards import ApiKeyGuard, BodySizeLimit, NamesApiServer, TrailingSlashes
from cluster.frontend.protocol import ResponseFormatter, now
from cluster.frontend.request_preparation import (
    PreparedRequest,
    check_request,
    prepare_chat,
    prepare_completion,
    require_served_model,
)
from cluster.frontend.request_schema import ChatCompletionRequest, CompletionRequest
from cluster.frontend.response_schema import (
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    ChatCompletion,
    Completion,
    ModelCard,
    ModelList,
    generation_responses,
)
from cluster.frontend.streaming import (
    RAW_SEND,
    ClientGone,
    collect_choices,
    event_stream,
    next_delta,
    unless_disconnected,
)
from engine.tracing import clock_ns

log = logging.getLogger(__name__)

# 499 (nginx's "client closed request") is only ever logged: nobody is there to read it.
CLIENT_CLOSED_REQUEST = 499
# A body this small is prepared (chat template, tokenizing: ~0.1 ms for 2 KB) on the event
# loop; a larger one, or one of unknown length, on a worker thread.
INLINE_PREPARE_BYTES = 2048


class ApiApp(FastAPI):
    """The FastAPI app, which also hands a stream the server's own `send` (RAW_SEND), so that
    its chunks skip the middlewares' wrappers of it, which only ever look at the response's
    start."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(
    backend: GenerationBackend,
    api_key: str | None = None,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    metrics_require_api_key: bool = False,
    admission: Admission | None = None,
    api_server: int | None = None,
) -> FastAPI:
    """An app serving `backend`. With `api_key`, /v1/* needs `Authorization: Bearer <key>`;
    /health stays open for load balancers and probes, and so does /metrics for scrapers unless
    `metrics_require_api_key`. A request body over `max_request_bytes` is refused with a 413.
    `admission` admits generation requests (default: one without limits, never draining); the
    caller keeps it to drain the server. `api_server`: this process's index among several API
    processes on one port, which every response names (API_SERVER_HEADER)."""
    if metrics_require_api_key and api_key is None:
        raise ValueError("metrics_require_api_key needs an api_key")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be positive, got {max_request_bytes}")
    gate = admission if admission is not None else Admission()
    app = ApiApp(title="pdcluster", docs_url=None, redoc_url=None, redirect_slashes=False)
    started = now()
    v1 = APIRouter(prefix="/v1", responses=error_responses(*COMMON_ERRORS))
    # Unknown model (404), admission (429, or 503 while draining or past the queue timeout).
    generation_errors = error_responses(400, 404, 429, 503)

    def model_card() -> dict[str, Any]:
        return {
            "id": backend.model_name,
            "object": "model",
            "created": started,
            "owned_by": "pdcluster",
            "max_model_len": backend.max_model_len,
        }

    @v1.get("/models", response_model=ModelList)
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model_id:path}", response_model=ModelCard, responses=error_responses(404))
    async def model(model_id: str) -> dict:
        require_served_model(model_id, backend)
        return model_card()

    @v1.get("/traces/{request_id}", responses=error_responses(404))
    async def trace(request_id: str) -> JSONResponse:
        # A backend that traces keeps a `traces` store (cluster.control.tracing.TraceStore).
        traces = getattr(backend, "traces", None)
        found = traces.get(request_id) if traces is not None else None
        if found is None:
            why = "it is unknown or too old" if traces is not None else "tracing is off"
            message = f"no trace for request {request_id!r}: {why}"
            raise OpenAIError(404, message, param="request_id", code="trace_not_found")
        return JSONResponse(found)

    @v1.post(
        "/chat/completions", responses=generation_responses(ChatCompletion) | generation_errors
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival_ns = clock_ns()
        check_request(body, backend, request.scope["path"])
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        admitted, prepared = await _admit_and_prepare(gate, prepare_chat, body, backend, request)
        return await _generate(request, backend, body, "chat", prepared, arrival_ns, admitted)

    @v1.post("/completions", responses=generation_responses(Completion) | generation_errors)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival_ns = clock_ns()
        check_request(body, backend, request.scope["path"])
        if body.echo:
            raise OpenAIError(400, "echo=true is not supported", param="echo")
        if body.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        admitted, prepared = await _admit_and_prepare(
            gate, prepare_completion, body, backend, request
        )
        return await _generate(request, backend, body, "completion", prepared, arrival_ns, admitted)

    @app.get("/health", responses=HEALTH_RESPONSES | error_responses(413))
    async def health() -> JSONResponse:
        report = await backend.health()
        if gate.draining:
            # Readiness probes and load balancers take a draining server out at once.
            report = {**report, "status": "draining", "in_flight": gate.in_flight}
        return JSONResponse(report, status_code=200 if report.get("status") == "ok" else 503)

    metrics_errors = (401, 404, 413) if metrics_require_api_key else (404, 413)

    # The Response class documents no JSON body of its own: the 200 is text (METRICS_RESPONSES).
    @app.get(
        "/metrics",
        response_class=Response,
        responses=METRICS_RESPONSES | error_responses(*metrics_errors),
    )
    async def metrics() -> Response:
        # A backend without metrics answers 404.
        render = getattr(backend, "metrics_text", None)
        if render is None:
            raise OpenAIError(404, "this backend exposes no metrics", type="not_found_error")
        return Response(await render(), media_type=METRICS_CONTENT_TYPE)

    app.include_router(v1)
    install_error_handlers(app, backend)
    # Added innermost first: a request meets TrailingSlashes, then ApiKeyGuard, then the limit.
    app.add_middleware(
        BodySizeLimit,
        max_bytes=max_request_bytes,
        on_too_large=lambda: count_failure(backend, "rejected"),
    )
    if api_key is not None:
        protected = ("/v1", "/metrics") if metrics_require_api_key else ("/v1",)
        app.add_middleware(ApiKeyGuard, api_key=api_key, protected=protected)
    app.add_middleware(TrailingSlashes)
    if api_server is not None:
        app.add_middleware(NamesApiServer, index=api_server)
    return app


async def _admit_and_prepare(
    gate: Admission,
    prepare: Callable[[Any, GenerationBackend], list[PreparedRequest]],
    body: ChatCompletionRequest | CompletionRequest,
    backend: GenerationBackend,
    request: Request,
) -> tuple[AdmittedRequest, list[PreparedRequest]]:
    """Admit the request before any work on it, then prepare it: on a worker thread, since
    that grows with the prompt and the event loop serves everyone, unless the body is small
    enough (INLINE_PREPARE_BYTES) that the hop to the thread would cost more than the work."""
    admitted = gate.admit()
    try:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) <= INLINE_PREPARE_BYTES:
            return admitted, prepare(body, backend)
        return admitted, await asyncio.to_thread(prepare, body, backend)
    except BaseException:
        admitted.release()
        raise


def _start_choices(
    backend: GenerationBackend,
    request_id: str,
    choices: list[ChoiceRequest],
    arrival_ns: int,
) -> AsyncIterator[TokenDelta]:
    """The backend requests of every choice, as one stream of deltas (tagged with their
    choice's index when there are several). A lone choice keeps the response's id as its
    request id, which its trace is found by. The samples of one prompt share its prefill
    where the backend can (`generate_samples`)."""

    def extension(choice: ChoiceRequest) -> dict[str, Any]:
        # Passed only when given, so that a backend without the extension serves the rest.
        given: dict[str, Any] = {}
        if choice.prompt_embeds is not None:
            given["prompt_embeds"] = choice.prompt_embeds
        # Likewise the timeline so far, only to a backend that traces (cluster.control.tracing).
        if getattr(backend, "traces", None) is not None:
            given["trace_events"] = [("arrival", arrival_ns), ("tokenized", clock_ns())]
        return given

    def start(choice: ChoiceRequest, choice_id: str) -> AsyncIterator[TokenDelta]:
        return backend.generate(choice_id, choice.prompt, choice.params, **extension(choice))

    if len(choices) == 1:
        return start(choices[0], request_id)
    share = getattr(backend, "generate_samples", None)
    streams = []
    for group in shared_prefill_groups(choices):
        ids = [f"{request_id}-{c.index}" for c in group]
        if share is None or len(group) == 1:
            streams += [start(c, choice_id) for c, choice_id in zip(group, ids)]
        else:
            params = [c.params for c in group]
            streams += share(ids, group[0].prompt, params, **extension(group[0]))
    return merge_choices(streams)


async def _generate(
    request: Request,
    backend: GenerationBackend,
    body: ChatCompletionRequest | CompletionRequest,
    kind: str,
    prepared: list[PreparedRequest],
    arrival_ns: int,
    admitted: AdmittedRequest,
) -> Response:
    params = prepared[0].params
    choices = choice_requests(
        [p.prompt for p in prepared], params, [p.prompt_embeds for p in prepared]
    )
    prompt_tokens = sum(len(p.prompt) for p in prepared)
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    formatter = ResponseFormatter(
        kind, request_id, backend, body.include_usage, tools=prepared[0].tools
    )
    started = time.perf_counter()
    # Closing `deltas` also ends the request's admission.
    deltas = admitted.watch(_start_choices(backend, request_id, choices, arrival_ns))

    def log_line(outcome: str, completion_tokens: int) -> None:
        log.info(
            "%s %s prompt=%d completion=%d %s %.3fs",
            request.url.path,
            request_id,
            prompt_tokens,
            completion_tokens,
            outcome,
            time.perf_counter() - started,
        )

    def usage_of(usages: list[dict[str, Any] | None]) -> dict[str, Any] | None:
        return total_usage(usages, choices)

    # Every way out closes `deltas` (aborting an unfinished request), except a started stream,
    # which closes them when it ends.
    stream_started = False
    try:
        if not body.stream:
            results = await unless_disconnected(request, collect_choices(deltas, len(choices)))
            reasons = ",".join(sorted({str(r.finish_reason) for r in results}))
            log_line(f"finish={reasons}", sum(len(r.token_ids) for r in results))
            usage = usage_of([r.usage for r in results])
            return JSONResponse(formatter.complete(results, usage))
        first = await unless_disconnected(request, next_delta(deltas))
        stream_started = True
    except ClientGone:
        log_line("client disconnected", 0)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        if not stream_started:
            await deltas.aclose()
    return event_stream(first, deltas, formatter, log_line, len(choices), usage_of)


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
