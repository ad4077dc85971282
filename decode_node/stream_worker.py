"""The stream worker: a process beside each node that generates, which turns the node's
StreamSteps (token ids, once per step) into the front ends' TokenFrames (decode_node.frames):
it detokenizes every request's new tokens and frames, signs and sends them, so that the thread
that drives the node's engine spends a step's streaming on one message.

The node starts it (`StreamWorker`), hands it its config as one JSON line on stdin, and reads
the endpoint of its inbox back from its stdout; every message between them is signed with the
cluster's key, as on the rest of the control plane. The worker exits when its stdin closes
(the node shut it down, or died). A worker that died makes the node fail its health probe,
and the cluster replaces the node (cluster.control.supervisor)."""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass

from metadata.control import Inbox, Outbox
from metadata.messages import ForgetFrontend, FrontendHello, StreamStep

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
RECEIVE_TIMEOUT_MS = 100


@dataclass(frozen=True)
class StreamWorkerConfig:
    node_name: str
    tokenizer: str  # the folder the node's tokenizer loads from
    host: str  # where the worker's inbox binds
    control_key: str  # hex
    log_level: str = "info"


class StreamWorker:
    """The node's handle on its stream worker: a StepSink (decode_node.token_streams) whose
    steps go to the worker's process. Used by the node's serving thread only."""

    def __init__(self, config: StreamWorkerConfig, timeout_s: float = START_TIMEOUT_S) -> None:
        self.config = config
        self.process = subprocess.Popen(
            [sys.executable, "-m", "decode_node.stream_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.process.stdin.write(json.dumps(asdict(config)) + "\n")
        self.process.stdin.flush()  # kept open: its end tells the worker to go
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        endpoint = self.process.stdout.readline().strip() if ready else ""
        if not endpoint.startswith("tcp://"):
            self.process.kill()
            raise RuntimeError(
                f"{config.node_name}: its stream worker did not start within {timeout_s:.0f} s"
                f" (exit status {self.process.poll()})"
            )
        self._outbox = Outbox(endpoint, bytes.fromhex(config.control_key))

    def apply(self, step: StreamStep) -> None:
        self._outbox.send(step)

    def hello(self, hello: FrontendHello) -> None:
        self._outbox.send(hello)

    def forget(self, frontend: int) -> None:
        self._outbox.send(ForgetFrontend(frontend))

    def error(self) -> str | None:
        """Why the worker is gone, if it is."""
        status = self.process.poll()
        return None if status is None else f"its stream worker exited with status {status}"

    def close(self) -> None:
        self._outbox.close()
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _exit_when_the_node_goes() -> None:
    sys.stdin.read()
    os._exit(0)


def main() -> None:
    config = StreamWorkerConfig(**json.loads(sys.stdin.readline()))
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s {config.node_name}-streams %(message)s",
    )
    from transformers import AutoTokenizer

    from decode_node.frames import FrameMaker
    from metadata.frontend_links import FrontendLinks

    key = bytes.fromhex(config.control_key)
    maker = FrameMaker(FrontendLinks(key), AutoTokenizer.from_pretrained(config.tokenizer))
    inbox = Inbox(config.host, key)
    print(inbox.endpoint, flush=True)
    threading.Thread(target=_exit_when_the_node_goes, daemon=True).start()
    while True:
        for msg in inbox.receive(RECEIVE_TIMEOUT_MS):
            if isinstance(msg, StreamStep):
                maker.apply(msg)
            elif isinstance(msg, FrontendHello):
                maker.hello(msg)
            elif isinstance(msg, ForgetFrontend):
                maker.forget(msg.frontend)
            else:
                log.warning("unexpected message %s", type(msg).__name__)


if __name__ == "__main__":
    main()
