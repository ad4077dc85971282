"""A node's sockets to the cluster's front ends (the API processes), by front-end id.

A front end introduces itself to every node with a FrontendHello (its id and its inbox's
endpoint) before its first request, and again to a node that replaced a dead one; a front end
that died is forgotten (`forget`, told by the cluster). Requests name their front end, so a node
streams each request's tokens to the one process that holds its HTTP connection, and reports its
load to all of them (`LoadReports`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from metadata.control import Outbox
from metadata.messages import NodeLoad

log = logging.getLogger(__name__)

# A node reports a change of its load at most this often, and its load at least this often.
LOAD_REPORT_MIN_INTERVAL_S = 0.02
LOAD_REPORT_MAX_INTERVAL_S = 2.0


class FrontendLinks:
    """Owned by the node's serving thread, like every socket."""

    def __init__(self, key: bytes, make_outbox: Callable[[str, bytes], Any] = Outbox) -> None:
        self._key = key
        self._make_outbox = make_outbox
        self._outboxes: dict[int, Any] = {}
        self._unknown_logged: set[int] = set()

    def open(self, frontend: int, endpoint: str) -> None:
        """(A FrontendHello) Send `frontend`'s messages to `endpoint` from now on."""
        old = self._outboxes.pop(frontend, None)
        if old is not None and old.endpoint == endpoint:
            self._outboxes[frontend] = old
            return
        if old is not None:
            old.close()
        self._outboxes[frontend] = self._make_outbox(endpoint, self._key)

    def forget(self, frontend: int) -> bool:
        """Close `frontend`'s socket; whether it was known."""
        outbox = self._outboxes.pop(frontend, None)
        if outbox is None:
            return False
        outbox.close()
        return True

    def knows(self, frontend: int) -> bool:
        return frontend in self._outboxes

    @property
    def frontends(self) -> list[int]:
        return list(self._outboxes)

    def send(self, frontend: int, msg: Any) -> bool:
        """Send `msg` to `frontend`; False (logged once per front end) when it is unknown: it
        never said hello, or it died."""
        outbox = self._outboxes.get(frontend)
        if outbox is None:
            if frontend not in self._unknown_logged:
                self._unknown_logged.add(frontend)
                log.warning("no socket to front end %#x: its messages are dropped", frontend)
            return False
        outbox.send(msg)
        return True

    def broadcast(self, msg: Any) -> None:
        for outbox in self._outboxes.values():
            outbox.send(msg)

    def close(self) -> None:
        for outbox in self._outboxes.values():
            outbox.close()
        self._outboxes.clear()


class LoadReports:
    """Tells every front end the node's load (`NodeLoad`) when it changed, at most every
    LOAD_REPORT_MIN_INTERVAL_S, and at least every LOAD_REPORT_MAX_INTERVAL_S (so a front end
    that said hello late learns it too): the routing policies weigh what the nodes report, not
    one front end's own share of the requests."""

    def __init__(
        self,
        links: FrontendLinks,
        role: str,
        index: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._links = links
        self._role, self._index = role, index
        self._clock = clock
        self._last: tuple[int, int, int] | None = None
        self._sent_at = float("-inf")
        self._frontends: tuple[int, ...] = ()

    def tick(self, requests: int, kv_used: int, kv_capacity: int) -> None:
        now = self._clock()
        load = (requests, kv_used, kv_capacity)
        frontends = tuple(self._links.frontends)
        since = now - self._sent_at
        changed = load != self._last or frontends != self._frontends
        if (
            not (changed and since >= LOAD_REPORT_MIN_INTERVAL_S)
            and since < LOAD_REPORT_MAX_INTERVAL_S
        ):
            return
        self._last, self._sent_at, self._frontends = load, now, frontends
        self._links.broadcast(NodeLoad(self._role, self._index, *load))
