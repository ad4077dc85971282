"""Control-plane sockets: each node has one inbox (PULL, bound to a port the OS picks) and an
outbox (PUSH) per peer it talks to. Only typed messages cross (metadata.messages). A socket is
used by one thread only, as ZMQ requires."""

from __future__ import annotations

import logging
from typing import Any

import zmq

from metadata.messages import MessageError, decode, encode

log = logging.getLogger(__name__)


class Inbox:
    def __init__(self, host: str, context: zmq.Context | None = None) -> None:
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"

    def receive(self, timeout_ms: int) -> list[Any]:
        """Every message waiting now, after waiting up to `timeout_ms` for the first one."""
        messages = []
        if not self._socket.poll(timeout_ms):
            return messages
        while True:
            try:
                data = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                messages.append(decode(data))
            except MessageError as err:
                # A malformed message is dropped with a log line; it must not take the node down.
                log.warning("dropped a malformed control message: %s", err)

    def close(self) -> None:
        self._socket.close(linger=0)


class Outbox:
    def __init__(self, endpoint: str, context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)

    def send(self, msg: Any) -> None:
        self._socket.send(encode(msg))

    def close(self) -> None:
        self._socket.close(linger=0)
