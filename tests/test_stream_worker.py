"""A node's stream worker (decode_node.stream_worker): the process that turns the node's
StreamSteps (token ids) into the front ends' TokenFrames with the text, so that the thread
driving the engine does no text work. It frames exactly what the in-node FrameMaker frames, lets
go of what the node dropped, and a worker that died shows in the node's health."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from tiny_models import byte_tokenizer

from decode_node.frames import FrameMaker
from decode_node.stream_worker import StreamWorker, StreamWorkerConfig
from decode_node.token_streams import TokenStreams
from engine.request import Request
from engine.sampling.sampling_params import SamplingParams
from metadata.control import Inbox
from metadata.control_auth import new_control_key
from metadata.frontend_links import FrontendLinks
from metadata.messages import FrontendHello, TokenFrame
from metadata.node_common import NodeOptions
from metadata.serving_node import ServingNode

FRONTEND = 3
EURO = list("€".encode())  # one character, three byte tokens


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("byte-tokenizer")
    byte_tokenizer().save_pretrained(path)
    return path


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run_steps(streams: TokenStreams, tokenizer) -> None:
    """Three requests over four steps: one ends by length, one by a stop string that
    straddles two steps, one is dropped (aborted) before its end."""
    reqs = {room: Request(str(room), [5, 6], SamplingParams(max_tokens=8)) for room in (1, 2, 3)}
    opened = {
        1: streams.open(FRONTEND, 1),
        2: streams.open(FRONTEND, 2, ("END",)),
        3: streams.open(FRONTEND, 3),
    }
    pieces = {1: ["ab", "c€", "d", "ef"], 2: ["xE", "NDy", "", ""], 3: ["q", "r", "", ""]}
    for step in range(4):
        for room, req in reqs.items():
            text = pieces[room][step]
            if not text or req.finished:
                continue
            req.output_token_ids.extend(ids(tokenizer, text))
            if room == 1 and step == 3:
                req.finish_reason = "length"
            if room == 2 and step == 1:
                req.finish_reason = "stop"
            streams.report(opened[room], req, lambda: {"n": 1})
        if step == 2:
            streams.drop(opened[3])
        streams.flush()


def frame_texts(frames: list[TokenFrame]) -> dict[int, tuple[str, str | None]]:
    """Each room's text and finish reason over the frames."""
    out: dict[int, list] = {}
    for frame in frames:
        ends = {end.entry: end for end in frame.ends}
        for entry, room in enumerate(frame.rooms):
            text, reason = out.get(room, ["", None])
            end = ends.get(entry)
            out[room] = [text + frame.texts[entry], end.finish_reason if end else reason]
    return {room: tuple(v) for room, v in out.items()}


class Recorder:
    endpoint = "tcp://recorded:1"

    def __init__(self) -> None:
        self.frames: list[TokenFrame] = []

    def send(self, msg) -> None:
        self.frames.append(msg)

    def close(self) -> None:
        pass


def test_the_worker_frames_what_the_node_itself_would(tokenizer_folder):
    tokenizer = byte_tokenizer()
    key = new_control_key()
    recorder = Recorder()
    links = FrontendLinks(key, make_outbox=lambda endpoint, key: recorder)
    links.open(FRONTEND, recorder.endpoint)
    maker = FrameMaker(links, tokenizer)
    run_steps(TokenStreams(maker, "decode-0"), tokenizer)
    in_node = frame_texts(recorder.frames)
    assert in_node == {1: ("abc€def", "length"), 2: ("x", "stop"), 3: ("qr", None)}
    assert len(maker) == 0, "every stream's state is gone: ended, or dropped"

    front_end = Inbox("127.0.0.1", key)
    config = StreamWorkerConfig("decode-0", str(tokenizer_folder), "127.0.0.1", key.hex())
    worker = StreamWorker(config)
    try:
        streams = TokenStreams(worker, "decode-0")
        streams.hello(FrontendHello(FRONTEND, front_end.endpoint))
        run_steps(streams, tokenizer)
        frames: list[TokenFrame] = []
        deadline = time.monotonic() + 30
        while len(frames) < len(recorder.frames) and time.monotonic() < deadline:
            frames += [m for m in front_end.receive(100) if isinstance(m, TokenFrame)]
        assert frame_texts(frames) == in_node
        assert [f.token_ids for f in frames] == [f.token_ids for f in recorder.frames]
        assert worker.error() is None
        worker.process.kill()
        worker.process.wait(timeout=30)
        assert "stream worker exited" in worker.error()
    finally:
        worker.close()
        front_end.close()


def test_a_dead_stream_worker_fails_the_nodes_probe():
    """A node's probe (`ping`, which the cluster's health watch calls) raises with why its
    streams cannot go out, so that the node is replaced (a stream worker's death)."""

    class DeadWorker:
        def error(self) -> str:
            return "its stream worker exited with status -9"

    streams = TokenStreams(DeadWorker(), "replica-0")

    class Node(ServingNode):
        def _serving_error(self) -> str | None:
            return streams.error()

    node = Node(NodeOptions("replica", 0, control_key=new_control_key()))
    node._thread = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    node._thread.start()
    with pytest.raises(RuntimeError, match="replica-0: its stream worker exited"):
        node.ping()
