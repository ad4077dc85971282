"""Calling into an event loop from any thread: the supervisor's thread changes the router's node
states on the router's loop, where the router's tasks read them."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any


def call_in_loop(
    loop: asyncio.AbstractEventLoop | None,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 30.0,
) -> Any:
    """Run `fn(*args)` on `loop` and return its result (from any thread; directly when `loop`
    is None or not running, or when called on it)."""
    if loop is None or loop.is_closed() or not loop.is_running():
        return fn(*args)
    try:
        if asyncio.get_running_loop() is loop:
            return fn(*args)
    except RuntimeError:
        pass  # no loop in this thread
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            future.set_exception(err)

    loop.call_soon_threadsafe(run)
    return future.result(timeout_s)
