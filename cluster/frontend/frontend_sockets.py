"""A front end's sockets on the control plane: its inbox (PULL, on a port the OS picks), where
the nodes' token frames and load reports and the controller's status arrive, and an outbox
(PUSH) to each node and to the controller, on each of which it introduces itself first
(FrontendHello). Every frame is signed with the cluster's key (metadata.control_auth); the inbox
drops and counts anything else."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import zmq

from cluster.control.node_state import NodeState
from metadata.control import AsyncInbox, Outbox
from metadata.messages import FrontendHello


class FrontEndSockets:
    def __init__(
        self,
        control_key: bytes,
        host: str,
        frontend_id: int | None = None,
        on_reject: Callable[[], None] | None = None,
    ) -> None:
        """`host`: where the inbox binds (the nodes must reach it); `frontend_id`: who this
        front end is to the nodes (default: drawn at random); `on_reject`: told of every
        message the inbox drops."""
        self._control_key = control_key
        self._inbox = AsyncInbox(host, control_key, on_reject)
        self.host = host
        self.endpoint = self._inbox.endpoint
        self.frontend_id = secrets.randbits(63) if frontend_id is None else frontend_id
        self.verifier = self._inbox.verifier
        # Outboxes on a plain (blocking-API) context: a send only queues the message, so it
        # needs no await, and an abort sent from a cancelled generator's `finally` still goes
        # out.
        self._send_context = zmq.Context()
        self._outboxes: dict[tuple[str, int], Outbox] = {}  # by (role, index)
        self._controller: Outbox | None = None
        self.closed = False

    def connect(self, node: NodeState) -> None:
        """Open (or re-open, to a replacement) the socket to `node` and introduce this front
        end on it, before anything else goes there."""
        key = ("prefill" if node.role == "prefill" else "decode", node.index)
        old = self._outboxes.get(key)
        outbox = Outbox(node.endpoint, self._control_key, self._send_context)
        self._outboxes[key] = outbox
        if old is not None:
            old.close()
        outbox.send(FrontendHello(self.frontend_id, self.endpoint))

    def connect_controller(self, endpoint: str) -> None:
        """Introduce this front end to the cluster's controller (one of several API
        processes: cluster.frontend.api_servers)."""
        self._controller = Outbox(endpoint, self._control_key, self._send_context)
        self._controller.send(FrontendHello(self.frontend_id, self.endpoint))

    def send_to_decode(self, index: int, msg: Any) -> None:
        """To decode node (or replica) `index`."""
        self._outboxes[("decode", index)].send(msg)

    async def receive(self) -> Any:
        """The next message that is signed, fresh and well formed."""
        return await self._inbox.receive()

    def close(self) -> None:
        """Close every socket and context now; idempotent, and safe once the serving event loop
        is gone. A context left to the garbage collector would block in term() on any socket
        still open, hanging whoever collects it."""
        if self.closed:
            return
        self.closed = True
        self._inbox.close()
        for outbox in self._outboxes.values():
            outbox.close()
        if self._controller is not None:
            self._controller.close()
        self._send_context.term()
