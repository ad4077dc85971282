"""What every serving node shares, whatever its role: its identity, the one thread that owns its
engine and sockets, the health and clock answers the router asks for, the data-plane channel it
opens when it joins the group, and the check that all of its pools are empty."""

from __future__ import annotations

import threading
from typing import Any

from engine.kv_cache import KVCacheManager
from engine.loader import ModelSpec
from engine.tracing import clock_ns
from metadata.buffers import MetadataBuffers
from metadata.control import Inbox
from metadata.node_common import NodeOptions, join_transfer_group, open_channels, transfer_spec
from metadata.transfer import KVReceiver, KVSender


class ServingNode:
    """Subclasses set `spec`, `kv_cache`, `metadata`, `inbox`, `speculator` and
    `num_draft_steps` in their constructor and implement `_serve` and `_open_channel`."""

    spec: ModelSpec
    kv_cache: KVCacheManager
    metadata: MetadataBuffers
    inbox: Inbox
    speculator: Any  # spec.MultiLayerEagleWorker or None (metadata does not import spec)
    num_draft_steps: int

    def __init__(self, options: NodeOptions) -> None:
        self.options = options
        self.rank = -1
        self._channel: KVSender | KVReceiver | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def describe(self) -> dict:
        spec = transfer_spec(self.spec, self.num_draft_steps)
        return {"endpoint": self.inbox.endpoint, "spec": spec.to_dict()}

    def join_group(
        self, store_host: str, store_port: int, rank: int, world_size: int, peers: list[int]
    ) -> None:
        join_transfer_group(
            self.spec,
            store_host,
            store_port,
            rank,
            world_size,
            through_host=self.options.transfer_through_host,
        )
        self.rank = rank
        self._channel = self._open_channel()
        open_channels(self._channel, peers, self.options.transfer_timeout_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name=self.options.name, daemon=True)
        self._thread.start()

    def ping(self) -> str:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError(f"{self.options.name}: its serving loop is not running")
        return "ok"

    def clock_ns(self) -> int:
        """This process's trace clock, for the router to align this node's timelines."""
        return clock_ns()

    def kv_is_empty(self) -> bool:
        drafts_empty = self.speculator is None or self.speculator.is_empty()
        return (
            self.kv_cache.is_empty()
            and drafts_empty
            and self.metadata.num_free == self.metadata.num_rows
        )

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._channel is not None:
            self._channel.close()

    def _open_channel(self) -> KVSender | KVReceiver:
        raise NotImplementedError

    def _serve(self) -> None:
        raise NotImplementedError
