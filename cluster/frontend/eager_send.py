"""Running an ASGI `send` at once, from a plain callback, without a task of its own.

A server's `send` of a body returns without suspending unless the connection's buffer is full
(uvicorn awaits its flow control only then). Run eagerly, the common write costs a call, not a
task and its scheduling; a send that does suspend (a client that reads slowly) is finished by
a task, which the caller awaits before its next write to keep the writes in order. This is
what asyncio's eager tasks (Python 3.12) do for any coroutine."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from starlette.types import Message, Send


def send_eagerly(send: Send, message: Message) -> asyncio.Task | None:
    """Run `send(message)` up to its first suspension: None when it completed (an exception
    it raised propagates), else the task that completes it."""
    coroutine = send(message)
    try:
        waited = coroutine.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_finish(coroutine, waited))


async def _finish(coroutine: Coroutine[Any, Any, None], waited: Any) -> None:
    """Drive `coroutine`, suspended on `waited` (an asyncio future, or None for a bare
    yield), to its end, as a task would."""
    try:
        while True:
            if waited is None:
                await asyncio.sleep(0)
            else:
                # A task resets this flag when it takes the future a coroutine yielded.
                waited._asyncio_future_blocking = False
                await asyncio.wait((waited,))
            waited = coroutine.send(None)  # the future's result or exception goes in
    except StopIteration:
        return
    except asyncio.CancelledError:
        coroutine.close()
        raise
