"""ASGI middleware that answers before any route runs or any body is parsed.

- `TrailingSlashes` serves `/v1/completions/` as `/v1/completions`. Starlette would instead
  answer a 307 whose Location is built from the client's Host header, and before any key check.
- `ApiKeyGuard` checks the bearer token on the protected paths before routing, so that no
  answer (404, 405) tells a caller without the key which routes exist.
- `BodySizeLimit` answers 413 to a body over the limit: at once when Content-Length says so,
  otherwise (a chunked body) as soon as the bytes read pass it.

Every answer has the OpenAI error body.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.frontend.protocol import error_body

log = logging.getLogger("cluster.frontend.openai_api")


async def _answer_error(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    body: dict,
    headers: dict[str, str] | None = None,
) -> None:
    log.info("%s %d: %s", scope["path"], status, body["error"]["message"])
    await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


class TrailingSlashes:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = dict(scope, path=path[:-1])
            raw_path = scope.get("raw_path")
            if isinstance(raw_path, bytes) and raw_path.endswith(b"/"):
                scope["raw_path"] = raw_path[:-1]
        await self.app(scope, receive, send)


class ApiKeyGuard:
    """Requires `Authorization: Bearer <api_key>` on every path under one of `protected`
    (a prefix such as "/v1" covers "/v1" and "/v1/...")."""

    def __init__(self, app: ASGIApp, api_key: str, protected: tuple[str, ...]) -> None:
        self.app = app
        # Compared as bytes: hmac.compare_digest refuses str with non-ASCII characters.
        self.expected = api_key.encode()
        self.protected = protected

    def protects(self, path: str) -> bool:
        return any(path == prefix or path.startswith(prefix + "/") for prefix in self.protected)

    def authorized(self, scope: Scope) -> bool:
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.expected
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.protects(scope["path"]) and not self.authorized(scope):
            body = error_body("missing or incorrect API key", code="invalid_api_key")
            headers = {"WWW-Authenticate": "Bearer"}
            await _answer_error(scope, receive, send, 401, body, headers)
            return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """`on_too_large` is called once for each body refused (the API counts it as rejected)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, on_too_large: Callable[[], None] = lambda: None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_too_large = on_too_large

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            # The HTTP server reads no more than Content-Length, and refuses a malformed one.
            if declared.strip().isdigit() and int(declared) > self.max_bytes:
                await self._too_large(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        whole = await self._read_body(receive)
        if whole is None:
            await self._too_large(scope, receive, send)
        elif whole["type"] == "http.request":
            await self.app(scope, _replaying(whole, receive), send)
        # Otherwise the client left while sending: nobody is there to answer.

    async def _read_body(self, receive: Receive) -> Message | None:
        """The body as one message, or None once it passes the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_too_large()
        message = (
            f"the request body is larger than this server's limit of {self.max_bytes} bytes "
            f"(--max-request-bytes)"
        )
        body = error_body(message, code="request_too_large")
        await _answer_error(scope, receive, send, 413, body)


def _replaying(whole: Message, receive: Receive) -> Receive:
    """A receive that gives the body read already, then what the server sends (a disconnect)."""
    pending = [whole]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


API_SERVER_HEADER = "x-pdcluster-api-server"


class NamesApiServer:
    """Names the API process that answered, one of several on one port, in every response
    (API_SERVER_HEADER): which process held a stream, for logs and tests."""

    def __init__(self, app: ASGIApp, index: int) -> None:
        self.app = app
        self.header = (API_SERVER_HEADER.encode(), str(index).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)
