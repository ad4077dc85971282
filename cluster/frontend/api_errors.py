"""The errors of the HTTP API: the exception the routes raise, the responses the OpenAPI schema
documents, and the handlers that turn every failure into the OpenAI error body."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.frontend.backend import BackendError, GenerationBackend
from cluster.frontend.protocol import ErrorResponse, error_body
from cluster.frontend.request_schema import describe_validation_error
from cluster.frontend.streaming import backend_error_body
from engine import RequestRejectedError

log = logging.getLogger("cluster.frontend.openai_api")

_ERROR_DESCRIPTIONS: dict[int | str, str] = {
    400: "Invalid request (the message names the field)",
    401: "Missing or incorrect API key",
    404: "Unknown model, route or trace",
    413: "Request body over the server's size limit",
    429: "Too many requests in flight (Retry-After)",
    503: "Draining, or no first token in time",
    "default": "Any other error, in the same body",
}


def error_responses(*statuses: int | str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of these error statuses, each with the OpenAI error body."""
    return {
        status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
        for status in statuses
    }


# What any path may answer: a wrong key, a body too large (refused before routing), and, as
# "default", anything else in the error body. A route with a body adds 400; "default" also
# keeps FastAPI from documenting the 422 this server never sends.
COMMON_ERRORS = (401, 413, "default")


class OpenAIError(Exception):
    """An error answered with the OpenAI body. `failure` is the kind it counts as in the
    backend's metrics: "rejected" for a 400 unless given, nothing for other statuses."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | int | None = None,
        type: str = "invalid_request_error",
        *,
        headers: dict[str, str] | None = None,
        failure: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers
        self.failure = failure if failure is not None or status != 400 else "rejected"


# The statuses of a request refused for what it is (invalid, or too large): "rejected" failures.
REJECTED_STATUSES = (400, 413)


def count_failure(backend: GenerationBackend, kind: str) -> None:
    """One failure of `kind` in the backend's metrics, when it keeps any."""
    metrics = getattr(backend, "metrics", None)
    if metrics is not None:
        metrics.failure(kind)


def install_error_handlers(app: FastAPI, backend: GenerationBackend) -> None:
    """Every 400 the HTTP layer answers counts as a "rejected" failure in the backend's metrics
    (when it has any), as the requests its `validate` refuses do, and so does the 413 of a body
    over the size limit (counted by http_guards.BodySizeLimit, which answers before any route);
    a refusal at admission (429, or 503 while draining) counts as "overloaded"."""

    def reply(
        request: Request, status: int, body: dict[str, Any], headers: dict | None = None
    ) -> JSONResponse:
        log.info("%s %d: %s", request.url.path, status, body["error"]["message"])
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, err: OpenAIError) -> JSONResponse:
        if err.failure is not None:
            count_failure(backend, err.failure)
        body = error_body(err.message, err.type, err.param, err.code)
        return reply(request, err.status, body, err.headers)

    @app.exception_handler(RequestRejectedError)
    async def rejected(request: Request, err: RequestRejectedError) -> JSONResponse:
        # Raised by backend.validate, which has counted it already.
        return reply(request, 400, error_body(str(err), param=err.param))

    @app.exception_handler(BackendError)
    async def backend_error(request: Request, err: BackendError) -> JSONResponse:
        return reply(request, err.status, backend_error_body(err))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        count_failure(backend, "rejected")
        message, param = describe_validation_error(err.errors())
        return reply(request, 400, error_body(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals: a body it cannot read (not UTF-8, say) is a 400.
        if err.status_code in REJECTED_STATUSES:
            count_failure(backend, "rejected")
        message = str(err.detail)
        if err.status_code == 405 and err.headers and "Allow" in err.headers:
            message = (
                f"{request.method} is not allowed on {request.url.path} "
                f"(allowed: {err.headers['Allow']})"
            )
        # Its headers are kept: the Allow of a 405, say.
        return reply(request, err.status_code, error_body(message), err.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets the usual error body.
        body = error_body(f"internal server error: {err!r}", type="server_error", code=500)
        return reply(request, 500, body)
