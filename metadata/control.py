"""Control-plane sockets: each node has one inbox (PULL, bound to a port the OS picks) and an
outbox (PUSH) per peer it talks to. Only typed messages cross (metadata.messages), each in a
frame signed with the cluster's key (metadata.control_auth): an inbox drops and counts anything
unsigned, forged or replayed. A socket is used by one thread only, as ZMQ requires."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from metadata.control_auth import FrameSigner, FrameVerifier
from metadata.messages import MessageError, decode, encode


class Inbox:
    def __init__(self, host: str, key: bytes, context: zmq.Context | None = None) -> None:
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._verifier = FrameVerifier(key, self.endpoint)

    @property
    def rejected(self) -> int:
        """Messages dropped so far: unauthenticated, forged, replayed or malformed."""
        return self._verifier.rejected

    def receive(self, timeout_ms: int) -> list[Any]:
        """Every message waiting now, after waiting up to `timeout_ms` for the first one."""
        messages = []
        if not self._socket.poll(timeout_ms):
            return messages
        while True:
            try:
                frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            data = self._verifier.open(frame)
            if data is None:
                continue
            try:
                messages.append(decode(data))
            except MessageError as err:
                # A malformed message is dropped and counted; it must not take the node down.
                self._verifier.reject(f"malformed message: {err}")

    def close(self) -> None:
        self._socket.close(linger=0)


class AsyncInbox:
    """An inbox for an asyncio event loop (a front end's, the controller's): `receive` awaits
    the next message that is signed, fresh and well formed, dropping and counting the rest.
    `on_reject` is told of every message dropped."""

    def __init__(self, host: str, key: bytes, on_reject: Callable[[], None] | None = None) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.endpoint = f"tcp://{host}:{port}"
        self.verifier = FrameVerifier(key, self.endpoint, on_reject=on_reject)

    async def receive(self) -> Any:
        socket, verifier = self._socket, self.verifier
        while True:
            data = verifier.open(await socket.recv())
            if data is None:
                continue
            try:
                return decode(data)
            except MessageError as err:
                verifier.reject(f"malformed message: {err}")

    def close(self) -> None:
        """Close the socket and its context; safe once the event loop is gone."""
        self._socket.close(linger=0)
        self._context.term()


class Outbox:
    def __init__(self, endpoint: str, key: bytes, context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self._signer = FrameSigner(key, endpoint)
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)

    def send(self, msg: Any) -> None:
        self._socket.send(self._signer.sign(encode(msg)))

    def close(self) -> None:
        self._socket.close(linger=0)
