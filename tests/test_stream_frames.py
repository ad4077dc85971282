"""Token streams in frames, without a cluster: a TokenFrame's columns are checked when it is
decoded, and decoding reflects on no type hints once a class has its codec; a node's
TokenStreams sends each front end one frame a step, holds tokens back below the stream interval
(never the first token nor the end), and drops what is meant for a front end it does not know;
a front end drops (and counts) a signed but malformed frame and goes on; a flight gives
everything its frames brought since its stream last read as one delta (an error after the
tokens before it), and the SSE response writes every delta ready at the time in one write."""

from __future__ import annotations

import asyncio
import json
import logging
import typing
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import zmq
from stream_recorder import CharTokenizer
from tiny_models import byte_tokenizer

from cluster.control.node_state import NodeState
from cluster.control.router import Router
from cluster.frontend.backend import BackendError, TokenDelta, make_usage
from cluster.frontend.choices import ChoiceDelta
from cluster.frontend.flights import Flight, FlightTable, NodeDied, next_delta
from cluster.frontend.protocol import ResponseFormatter
from cluster.frontend.streaming import EventStreamResponse
from decode_node.frames import FrameMaker
from decode_node.token_streams import TokenStreams
from engine import SamplingParams, TokenLogprob
from engine.request import Request
from metadata.control import Inbox, Outbox
from metadata.control_auth import new_control_key
from metadata.frontend_links import FrontendLinks
from metadata.messages import (
    PROTOCOL_VERSION,
    FrontendHello,
    GenerateRequest,
    MessageError,
    NodeLoad,
    ParallelSample,
    SamplingSpec,
    StreamEnd,
    StreamLogprobs,
    TokenFrame,
    decode,
    encode,
)

NODE = "replica-0"

# --- messages ---

FRAME = TokenFrame(
    rooms=[11, 12, 13],
    num_tokens=[2, 0, 1],
    token_ids=[5, 6, 7],
    texts=["ab", "", "c"],
    logprobs=[StreamLogprobs(0, [[5, -0.5, [[5, -0.5], [9, -1.5]]], [6, -0.25, []]])],
    ends=[StreamEnd(1, error=f"{NODE}: boom"), StreamEnd(2, "stop", stats={"decode_node": 0})],
)


def wire_body(msg) -> dict:
    """A message's body as it crosses the wire."""
    return msgpack.unpackb(encode(msg))["body"]


def packed(body: dict, kind: str = "TokenFrame", version: int = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"type": kind, "version": version, "body": body})


def test_a_token_frame_round_trips():
    assert decode(encode(FRAME)) == FRAME
    assert decode(packed(wire_body(FRAME))) == FRAME
    empty = TokenFrame([], [], [], [])
    assert decode(encode(empty)) == empty


def _changed(**fields) -> dict:
    return wire_body(FRAME) | fields


def _end(entry) -> dict:
    return {"entry": entry, "finish_reason": "stop", "error": None, "stats": {}}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        pytest.param(packed(_changed(rooms=[11, 12])), "differ in length", id="rooms"),
        pytest.param(packed(_changed(num_tokens=[2, 0, 1, 0])), "differ", id="num_tokens"),
        pytest.param(packed(_changed(texts=["ab", "c"])), "differ in length", id="texts"),
        pytest.param(packed(_changed(num_tokens=[4, -1, 0])), "negative", id="negative-count"),
        pytest.param(packed(_changed(token_ids=[5, 6])), "add up", id="token-total"),
        pytest.param(packed(_changed(num_tokens=[2, 0, 2])), "add up", id="count-total"),
        pytest.param(
            packed(_changed(logprobs=[{"entry": 3, "logprobs": []}])), "out of range", id="lp"
        ),
        pytest.param(packed(_changed(ends=[_end(-1)])), "out of range", id="end-negative"),
        pytest.param(packed(_changed(ends=[_end(3)])), "out of range", id="end-past"),
        pytest.param(packed(_changed(rooms=[11, True, 13])), "list of int", id="bool-room"),
        pytest.param(packed(_changed(token_ids=[5, False, 7])), "list of int", id="bool-token"),
        pytest.param(packed(_changed(ends=[_end(True)])), "expected int", id="bool-entry"),
        pytest.param(
            packed(wire_body(NodeLoad("replica", 0, 1, 0, 8)) | {"requests": True}, "NodeLoad"),
            "expected int",
            id="bool-load",
        ),
        pytest.param(packed(_changed(rooms=[11.0, 12, 13])), "list of int", id="float-room"),
        pytest.param(packed(_changed(sent_at=1)), "no field", id="unknown-field"),
        pytest.param(
            packed(_changed(ends=[_end(2) | {"node": "x"}])), "no field", id="unknown-nested"
        ),
        pytest.param(
            packed({k: v for k, v in wire_body(FRAME).items() if k != "texts"}),
            "lacks field",
            id="missing-field",
        ),
        pytest.param(packed(wire_body(FRAME), version=PROTOCOL_VERSION - 1), "version", id="old"),
        pytest.param(packed(wire_body(FRAME), version=PROTOCOL_VERSION + 1), "version", id="new"),
    ],
)
def test_a_frame_whose_fields_disagree_or_are_mistyped_is_refused(data, match):
    with pytest.raises(MessageError, match=match):
        decode(data)


def test_decoding_reflects_on_no_type_hints_once_a_class_has_its_codec(monkeypatch):
    sampling = SamplingSpec(8, 0.0, 0, 1.0, None, ["zz"], [], False, 2, logit_bias=[[3, 1.5]])
    messages = [
        FRAME,
        NodeLoad("replica", 0, 3, 96, 1024),
        FrontendHello(7, "tcp://127.0.0.1:9"),
        GenerateRequest(1, "r", [3, 4], sampling, 0, 7, samples=[ParallelSample(2, "r-1", 5)]),
    ]
    wire = [encode(m) for m in messages]
    assert [decode(data) for data in wire] == messages  # every codec built here, once

    def reflect(*args, **kwargs):
        raise AssertionError("a message reflected on its type hints")

    monkeypatch.setattr(typing, "get_type_hints", reflect)
    for _ in range(3):
        assert [decode(data) for data in wire] == messages
        assert [encode(m) for m in messages] == wire
    with pytest.raises(MessageError, match="add up"):
        decode(packed(_changed(token_ids=[5])))


# --- a node's token streams ---


class RecordingOutbox:
    """Stands for a node's socket to one front end."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        pass


class FrontEnds:
    """A node's FrontendLinks whose sockets record what they are sent, by front-end id."""

    def __init__(self, *frontends: int) -> None:
        self.outboxes: dict[str, RecordingOutbox] = {}
        self.links = FrontendLinks(new_control_key(), make_outbox=self._outbox)
        for frontend in frontends:
            self.links.open(frontend, self.endpoint(frontend))

    @staticmethod
    def endpoint(frontend: int) -> str:
        return f"tcp://front-end-{frontend}.test:1"

    def _outbox(self, endpoint: str, key: bytes) -> RecordingOutbox:
        return self.outboxes.setdefault(endpoint, RecordingOutbox(endpoint))

    def sent(self, frontend: int) -> list:
        return self.outboxes[self.endpoint(frontend)].sent


def request(room: int, max_tokens: int = 64) -> Request:
    return Request(str(room), [1, 2, 3], SamplingParams(max_tokens=max_tokens))


def entries(frame: TokenFrame) -> list[tuple[int, list[int], str]]:
    """(room, tokens, text) of each entry."""
    out, offset = [], 0
    for room, count, text in zip(frame.rooms, frame.num_tokens, frame.texts):
        out.append((room, frame.token_ids[offset : offset + count], text))
        offset += count
    return out


def test_a_step_of_64_requests_gives_each_front_end_one_frame_with_every_entry():
    fronts = FrontEnds(1, 2)
    streams = TokenStreams(FrameMaker(fronts.links, CharTokenizer()), NODE)
    expected: dict[int, list] = {1: [], 2: []}
    ends: dict[int, dict[int, tuple]] = {1: {}, 2: {}}
    logprobs: dict[int, dict[int, list]] = {1: {}, 2: {}}
    for i in range(64):
        frontend, room = 1 + i % 2, 1000 + i
        stream = streams.open(frontend, room)
        req = request(room)
        if i == 63:
            req.error = "forward failed"
            streams.report(stream, req, dict)
            expected[frontend].append((room, [], ""))
            ends[frontend][room] = (None, f"{NODE}: forward failed", {})
            continue
        req.output_token_ids = [65 + (i + j) % 26 for j in range(1 + i % 4)]
        if i % 3 == 0:
            req.logprobs = [
                TokenLogprob(t, -0.5 - j, [(t, -0.5 - j)])
                for j, t in enumerate(req.output_token_ids)
            ]
            logprobs[frontend][room] = [
                [lp.token_id, lp.logprob, [list(p) for p in lp.top_logprobs]] for lp in req.logprobs
            ]
        if i % 5 == 0:
            req.finish_reason = "length"
            ends[frontend][room] = ("length", None, {"room": room})
        streams.report(stream, req, lambda room=room: {"room": room})
        text = "".join(map(chr, req.output_token_ids))
        expected[frontend].append((room, req.output_token_ids, text))
    for frontend in (1, 2):
        assert fronts.sent(frontend) == [], "nothing goes out before the step's flush"
    streams.flush()

    for frontend in (1, 2):
        [frame] = fronts.sent(frontend)
        assert decode(encode(frame)) == frame  # its columns agree
        assert entries(frame) == expected[frontend]
        assert len(frame.rooms) == 32
        got_ends = {
            frame.rooms[end.entry]: (end.finish_reason, end.error, end.stats) for end in frame.ends
        }
        assert got_ends == ends[frontend]
        got_logprobs = {frame.rooms[lp.entry]: lp.logprobs for lp in frame.logprobs}
        assert got_logprobs == logprobs[frontend]
    assert streams.tokens_out == sum(len(tokens) for f in (1, 2) for _, tokens, _ in expected[f])
    streams.flush()
    assert [len(fronts.sent(frontend)) for frontend in (1, 2)] == [1, 1], "no news, no frame"


def test_the_interval_holds_tokens_back_until_that_many_are_new_but_not_the_first_or_the_end():
    tokenizer = byte_tokenizer()
    fronts = FrontEnds(1)
    streams = TokenStreams(FrameMaker(fronts.links, tokenizer), NODE, interval=3)
    output = tokenizer.encode("ab€cd", add_special_tokens=False)  # € is three tokens
    assert len(output) == 7
    stream, req = streams.open(1, 5), request(5, max_tokens=7)
    frames_after_step = []
    for step in range(1, len(output) + 1):
        req.output_token_ids = output[:step]
        if step == len(output):
            req.finish_reason = "length"
        streams.report(stream, req, dict)
        streams.flush()
        frames_after_step.append(len(fronts.sent(1)))
    # The first token at once, then three new ones at step 4, then the rest with the end.
    assert frames_after_step == [1, 1, 1, 2, 2, 2, 3]
    first, middle, last = fronts.sent(1)
    assert entries(first) == [(5, output[:1], "a")]
    [(_, tokens, text)] = entries(middle)
    assert tokens == output[1:4] and text in ("", "b"), "never a part of €"
    assert entries(last) == [(5, output[4:], "ab€cd"[1 + len(text) :])]
    assert [(e.entry, e.finish_reason) for e in last.ends] == [(0, "length")]
    assert not first.ends and not middle.ends

    # An end comes out at once, however few tokens are new, and so does an error.
    stream, req = streams.open(1, 6), request(6, max_tokens=2)
    req.output_token_ids = output[:1]
    streams.report(stream, req, dict)
    req.output_token_ids, req.finish_reason = output[:2], "stop"
    streams.report(stream, req, dict)
    failing, failed = streams.open(1, 7), request(7)
    failed.output_token_ids = output[:1]
    streams.report(failing, failed, dict)
    failed.output_token_ids, failed.error = output[:2], "out of memory"
    streams.report(failing, failed, dict)
    streams.flush()
    frame = fronts.sent(1)[-1]
    assert entries(frame) == [
        (6, output[:1], "a"),
        (6, output[1:2], "b"),
        (7, output[:1], "a"),
        (7, [], ""),
    ]
    assert [(e.entry, e.finish_reason, e.error) for e in frame.ends] == [
        (1, "stop", None),
        (3, None, f"{NODE}: out of memory"),
    ]


def test_a_frame_for_an_unknown_front_end_is_dropped_not_raised(caplog):
    fronts = FrontEnds(1)
    streams = TokenStreams(FrameMaker(fronts.links, CharTokenizer()), NODE)
    for frontend, room in ((1, 10), (99, 11), (99, 12)):
        req = request(room)
        req.output_token_ids = [ord("x")]
        streams.report(streams.open(frontend, room), req, dict)
    with caplog.at_level(logging.WARNING, logger="metadata.frontend_links"):
        streams.flush()
        streams.fail(99, 13, f"{NODE}: gone")
        streams.flush()
    [frame] = fronts.sent(1)
    assert entries(frame) == [(10, [ord("x")], "x")]
    assert list(fronts.outboxes) == [FrontEnds.endpoint(1)]
    assert [r.getMessage() for r in caplog.records] == [
        "no socket to front end 0x63: its messages are dropped"
    ], "logged once per front end"


# --- a front end ---


async def _no_news():
    return None


def fake_spec() -> SimpleNamespace:
    """What a Router reads of a model."""
    return SimpleNamespace(
        tokenizer=CharTokenizer(),
        path=Path("tiny"),
        engine_config=SimpleNamespace(max_model_len=64, max_tokens_cap=None, max_num_seqs=4),
        model_config=SimpleNamespace(vocab_size=320, hidden_size=64),
    )


async def _received(inbox: Inbox, kind: type, timeout_s: float = 10.0) -> list:
    """What `inbox` received until a message of `kind`."""
    messages: list = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not any(isinstance(m, kind) for m in messages):
        assert loop.time() < deadline, f"no {kind.__name__} came, only {messages}"
        messages += await asyncio.to_thread(inbox.receive, 100)
    return messages


def test_a_signed_but_malformed_frame_is_dropped_and_counted_and_the_front_end_goes_on():
    async def scenario() -> None:
        key = new_control_key()
        context = zmq.Context()
        node_inbox = Inbox("127.0.0.1", key, context)
        node = NodeState("replica", 0, _no_news, endpoint=node_inbox.endpoint)
        router = Router(fake_spec(), [], [node], kv_cache_tokens=1024, control_key=key)
        to_front_end = Outbox(router.endpoint, key, context)
        try:
            stream = router.generate("req-1", [3, 4, 5], SamplingParams(max_tokens=4))
            first = asyncio.ensure_future(anext(stream))
            hello, *rest = await _received(node_inbox, GenerateRequest)
            assert hello == FrontendHello(router.frontend_id, router.endpoint)
            [generate] = rest
            room = generate.room
            # Signed with the cluster's key, so they pass authentication; each is malformed.
            to_front_end.send(TokenFrame([room], [2], [5], ["x"]))
            to_front_end.send(TokenFrame([room], [True], [5], ["x"]))
            to_front_end.send(TokenFrame([room], [1], [5], ["x"], ends=[StreamEnd(1, "stop")]))
            to_front_end.send(TokenFrame([room], [2], [5, 6], ["ab"], ends=[StreamEnd(0, "stop")]))
            delta = await asyncio.wait_for(first, 10)
            assert (delta.token_ids, delta.text, delta.finish_reason) == ([5, 6], "ab", "stop")
            assert router.sockets.verifier.rejected == 3

            # And it serves the next request.
            stream = router.generate("req-2", [3], SamplingParams(max_tokens=1))
            first = asyncio.ensure_future(anext(stream))
            [generate] = await _received(node_inbox, GenerateRequest)
            to_front_end.send(
                TokenFrame([generate.room], [1], [7], ["g"], ends=[StreamEnd(0, "length")])
            )
            delta = await asyncio.wait_for(first, 10)
            assert (delta.token_ids, delta.text, delta.finish_reason) == ([7], "g", "length")
        finally:
            await router.close()
            to_front_end.close()
            node_inbox.close()
            context.term()

    asyncio.run(scenario())


# --- a flight's deltas ---


class Timer:
    def __init__(self) -> None:
        self.counted: list = []

    def tokens(self, count: int) -> None:
        self.counted.append(count)

    def finished(self, finish_reason: str, usage: dict) -> None:
        self.counted.append(finish_reason)

    def failed(self, kind: str) -> None:
        self.counted.append(f"failed: {kind}")


ROOM = 77


def flight_table() -> tuple[FlightTable, Flight, NodeState]:
    node = NodeState("replica", 0, _no_news)
    flight = Flight(None, node, ROOM, prompt_tokens=3, timer=Timer(), timeline=None)
    table = FlightTable()
    table.add(flight)
    return table, flight, node


def frame(tokens: list[int], text: str, end: StreamEnd | None = None, lp: bool = False):
    logprobs = [StreamLogprobs(0, [[t, -float(t), []] for t in tokens])] if lp else []
    return TokenFrame([ROOM], [len(tokens)], tokens, [text], logprobs, [end] if end else [])


def test_frames_delivered_before_the_stream_reads_give_one_delta_in_order():
    async def scenario() -> None:
        table, flight, _ = flight_table()
        table.deliver(frame([1, 2], "ab", lp=True))
        table.deliver(frame([3], "c", lp=True))
        table.deliver(TokenFrame([ROOM + 1, ROOM], [1, 1], [9, 4], ["z", ""], []))
        table.deliver(frame([5, 6], "de", lp=True))
        delta = await next_delta(flight, "prefill", None)
        assert delta.token_ids == [1, 2, 3, 4, 5, 6] and delta.text == "abcde"
        assert [lp.token_id for lp in delta.logprobs] == [1, 2, 3, 5, 6]
        assert delta.finish_reason is None

        table.deliver(frame([7], "f"))
        table.deliver(frame([8], "g", StreamEnd(0, "stop")))
        table.deliver(frame([9], "h"))  # nothing comes after an end
        last = await next_delta(flight, "prefill", None)
        assert (last.token_ids, last.text, last.finish_reason) == ([7, 8], "fg", "stop")
        assert last.usage["completion_tokens"] == 8
        assert flight.timer.counted == [6, 2, "stop"]

    asyncio.run(scenario())


def test_an_error_after_tokens_is_raised_once_those_tokens_are_taken():
    async def scenario() -> None:
        table, flight, _ = flight_table()
        table.deliver(frame([1, 2], "ab"))
        table.deliver(frame([3], "c"))
        table.deliver(frame([], "", StreamEnd(0, error=f"{NODE}: decode step failed")))
        delta = await next_delta(flight, "prefill", None)
        assert (delta.token_ids, delta.text, delta.finish_reason) == ([1, 2, 3], "abc", None)
        with pytest.raises(BackendError, match=f"{NODE}: decode step failed") as failure:
            await next_delta(flight, "prefill", None)
        assert failure.value.stage == "decode"

        # A node that died, likewise.
        table, flight, node = flight_table()
        table.deliver(frame([4], "d"))
        node.error = "ActorDiedError: gone"
        flight.fail(NodeDied(node, "decode"))
        delta = await next_delta(flight, "prefill", None)
        assert (delta.token_ids, delta.text) == ([4], "d")
        with pytest.raises(BackendError, match="replica-0 died: ActorDiedError") as failure:
            await next_delta(flight, "prefill", None)
        assert failure.value.status == 503

    asyncio.run(scenario())


# --- the SSE response ---


class ReadyDeltas:
    """A backend's deltas in steps, each step's deltas ready together: `steps[0]` are ready
    with the response's first delta; `__anext__` waits for the next step's first delta, and
    `ready()` takes what else is ready."""

    def __init__(self, steps: list[list[TokenDelta]]) -> None:
        self._ready, *self._steps = steps

    async def __anext__(self) -> TokenDelta:
        if not self._ready:
            if not self._steps:
                raise StopAsyncIteration
            self._ready = self._steps.pop(0)
        return self._ready.pop(0)

    def ready(self) -> list[TokenDelta]:
        taken, self._ready = self._ready, []
        return taken

    def __aiter__(self) -> ReadyDeltas:
        return self

    async def aclose(self) -> None:
        pass


def respond(first: TokenDelta, deltas: ReadyDeltas, num_choices: int = 1) -> list[bytes]:
    """The body writes of the SSE response."""
    backend = SimpleNamespace(model_name="tiny", tokenizer=CharTokenizer())
    formatter = ResponseFormatter("completion", "cmpl-1", backend, include_usage=False)
    response = EventStreamResponse(first, deltas, formatter, lambda *_: None, num_choices)
    messages: list[dict] = []

    async def send(message: dict) -> None:
        messages.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client stays
        return {"type": "http.disconnect"}

    asyncio.run(response({"type": "http"}, receive, send))
    assert messages[0]["type"] == "http.response.start"
    bodies = messages[1:]
    assert all(m["type"] == "http.response.body" for m in bodies)
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    return [m["body"] for m in bodies]


def events(body: bytes) -> list:
    assert body.endswith(b"\n\n")
    payloads = [event.removeprefix(b"data: ") for event in body[:-2].split(b"\n\n")]
    return [json.loads(p) if p != b"[DONE]" else "[DONE]" for p in payloads]


def _chunk(event) -> tuple:
    [choice] = event["choices"]
    return choice["index"], choice["text"], choice["token_ids"], choice["finish_reason"]


def test_every_delta_ready_goes_out_in_one_write():
    usage = make_usage(3, 5)
    deltas = ReadyDeltas(
        [
            [TokenDelta([2], "b"), TokenDelta([3], "c")],
            [TokenDelta([4], "d"), TokenDelta([5], "e", finish_reason="stop", usage=usage)],
        ]
    )
    writes = respond(TokenDelta([1], "a"), deltas)
    assert len(writes) == 2
    assert [_chunk(e) for e in events(writes[0])] == [(0, "abc", [1, 2, 3], None)]
    assert [_chunk(e) if e != "[DONE]" else e for e in events(writes[1])] == [
        (0, "de", [4, 5], "stop"),
        "[DONE]",
    ]


def test_every_choices_ready_deltas_go_out_in_one_write_one_chunk_per_choice():
    usage = make_usage(3, 2)
    deltas = ReadyDeltas(
        [
            [
                ChoiceDelta([7], "x", index=1),
                ChoiceDelta([2], "b", finish_reason="stop", usage=usage, index=0),
                ChoiceDelta([8], "y", finish_reason="length", usage=usage, index=1),
            ]
        ]
    )
    [write] = respond(ChoiceDelta([1], "a", index=0), deltas, num_choices=2)
    assert [_chunk(e) if e != "[DONE]" else e for e in events(write)] == [
        (0, "ab", [1, 2], "stop"),
        (1, "xy", [7, 8], "length"),
        "[DONE]",
    ]
