"""The prefill nodes a decode node pairs with: a control-plane outbox to each, and the check
that refuses to pair with one whose transfers this node could not receive."""

from __future__ import annotations

from metadata.control import Outbox
from metadata.handshake import PairingError, TransferSpec, check_compatible


class PrefillPeers:
    def __init__(self, node_name: str, mine: TransferSpec, control_key: bytes) -> None:
        self.node_name = node_name
        self.mine = mine
        self.control_key = control_key
        self.outboxes: dict[int, Outbox] = {}

    def connect(self, endpoints: dict[int, str], specs: dict[int, dict]) -> None:
        """Pair with every prefill node, refusing (PairingError) any whose KV layout, dtype,
        model or spec_hidden_size differs from this node's."""
        for index in sorted(specs):
            self._check(index, specs[index])
        self.outboxes = {i: Outbox(e, self.control_key) for i, e in endpoints.items()}

    def replace(self, index: int, endpoint: str, spec: dict) -> Outbox | None:
        """prefill-`index` is now the node at `endpoint`: check that it can pair and send there
        from now on; returns the old outbox, for the thread that owns the sockets to close."""
        self._check(index, spec)
        old = self.outboxes.get(index)
        self.outboxes[index] = Outbox(endpoint, self.control_key)
        return old

    def send(self, index: int, message: object) -> None:
        self.outboxes[index].send(message)

    def _check(self, index: int, spec: dict) -> None:
        try:
            check_compatible(TransferSpec.from_dict(spec), self.mine)
        except PairingError as err:
            raise PairingError(f"prefill-{index} and {self.node_name}: {err}") from None
