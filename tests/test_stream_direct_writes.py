"""A stream's chunks written by the delivery of its frames: while a lone choice's SSE response
waits for news, the call that delivers a frame writes the chunk of its tokens itself (no task
wake-up per stream per step); a write that must wait for a slow client holds the next news
back, which then goes out as one chunk after it, in order; ends, errors and an ended
request take the stream's own way, and the text is the same whichever way a chunk went."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from stream_recorder import CharTokenizer

from cluster.control.node_state import NodeState
from cluster.frontend.admission import Admission
from cluster.frontend.backend import BackendError
from cluster.frontend.flights import Flight, FlightTable, next_delta, take_tokens
from cluster.frontend.protocol import ResponseFormatter
from cluster.frontend.sample_streams import SharedPrefill
from cluster.frontend.streaming import RAW_SEND, EventStreamResponse
from metadata.messages import StreamEnd, TokenFrame

ROOM = 5


class Timer:
    def tokens(self, count: int) -> None:
        pass

    def finished(self, finish_reason: str, usage: dict) -> None:
        pass

    def failed(self, kind: str) -> None:
        pass


async def _no_news() -> None:
    return None


def frame(tokens: list[int], text: str, end: StreamEnd | None = None) -> TokenFrame:
    return TokenFrame([ROOM], [len(tokens)], tokens, [text], [], [end] if end else [])


class Client:
    """The server's side of one connection: the messages sent, and a switch that makes body
    writes wait (a client that reads slowly) until `catch_up`."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.slow = False
        self._caught_up = asyncio.Event()
        self.gone = asyncio.Event()

    async def send(self, message: dict) -> None:
        self.messages.append(message)

    async def raw_send(self, message: dict) -> None:
        if self.slow:
            await self._caught_up.wait()
        self.messages.append(message)

    def catch_up(self) -> None:
        self.slow = False
        self._caught_up.set()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    @property
    def texts(self) -> list[list]:
        """Each body write's events: the chunk's text and finish reason, or the marker."""
        writes = []
        for message in self.messages[1:]:
            body = message["body"]
            events = [e.removeprefix(b"data: ") for e in body[:-2].split(b"\n\n")]
            writes.append(
                [
                    e.decode() if e == b"[DONE]" else _text_and_finish(json.loads(e))
                    for e in events
                ]
            )
        return writes


def _text_and_finish(event: dict):
    if "error" in event:
        return ("error", event["error"]["message"])
    [choice] = event["choices"]
    return choice["text"], choice["finish_reason"]


async def start_stream(client: Client, logged: list):
    """A flight, its stream as the router makes it (SharedPrefill), admitted and watched, its
    first token taken, and its SSE response running."""
    node = NodeState("replica", 0, _no_news)
    flight = Flight(None, node, ROOM, prompt_tokens=2, timer=Timer(), timeline=None)
    table = FlightTable()
    table.add(flight)
    aborted: list[Flight] = []

    async def open_flights(wanted: list[int]) -> list[Flight]:
        return [flight]

    def end(ended: Flight) -> None:
        if table.end(ended) and not ended.finished:
            aborted.append(ended)

    [stream] = SharedPrefill(
        1, open_flights, lambda f: next_delta(f, "prefill", None), end, take_tokens
    ).streams
    admitted = Admission().admit()
    deltas = admitted.watch(stream)
    table.deliver(frame([1], "a"))
    first = await anext(deltas)
    backend = SimpleNamespace(model_name="tiny", tokenizer=CharTokenizer())
    formatter = ResponseFormatter("completion", "cmpl-1", backend, include_usage=False)
    response = EventStreamResponse(first, deltas, formatter, lambda *line: logged.append(line))
    scope = {"type": "http", RAW_SEND: client.raw_send}
    task = asyncio.ensure_future(response(scope, client.receive, client.send))
    while len(client.messages) < 2 or flight.waiter is None:
        await asyncio.sleep(0)
    return SimpleNamespace(
        table=table, flight=flight, admitted=admitted, task=task, aborted=aborted
    )


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_the_delivery_writes_each_steps_chunk_and_a_slow_clients_news_coalesces_after_it():
    async def scenario() -> None:
        client, logged = Client(), []
        s = await start_stream(client, logged)
        assert client.texts == [[("a", None)]]

        # Written by the delivering call itself, before the event loop runs anything.
        s.table.deliver(frame([2], "b"))
        assert client.texts[-1] == [("b", None)]
        s.table.deliver(frame([3, 4], "cd"))
        assert client.texts[-1] == [("cd", None)]

        # The client falls behind: that write waits, and what comes meanwhile waits for it.
        client.slow = True
        s.table.deliver(frame([5], "e"))
        s.table.deliver(frame([6], "f"))
        await settle()
        s.table.deliver(frame([7], "g"))
        await settle()
        assert len(client.texts) == 3
        client.catch_up()
        await settle()
        assert client.texts[3:] == [[("e", None)], [("fg", None)]]

        # Written directly again once the stream's task is parked; the end takes its way.
        s.table.deliver(frame([8], "h"))
        assert client.texts[-1] == [("h", None)]
        s.table.deliver(frame([9], "i", StreamEnd(0, "stop")))
        await s.task
        assert client.texts[-1] == [("i", "stop"), "[DONE]"]
        assert "".join(t[0][0] for t in client.texts) == "abcdefghi"
        assert client.messages[-1]["more_body"] is False
        assert logged == [("finish=stop", 9)]
        assert s.aborted == [] and len(s.table) == 0

    asyncio.run(scenario())


def test_an_ended_request_or_a_gone_client_gets_no_more_direct_writes_and_is_aborted():
    async def scenario() -> None:
        client, logged = Client(), []
        s = await start_stream(client, logged)
        s.admitted.end(BackendError("the drain ended this request", stage="drain"))
        s.table.deliver(frame([2], "b"))  # declined: the stream's task ends the request
        await s.task
        assert client.texts[1:] == [[("error", "the drain ended this request (drain)"), "[DONE]"]]
        assert s.aborted == [s.flight] and len(s.table) == 0

        client, logged = Client(), []
        s = await start_stream(client, logged)
        s.table.deliver(frame([2], "b"))
        client.gone.set()
        await s.task
        assert s.aborted == [s.flight] and len(s.table) == 0
        s.table.deliver(frame([3], "c"))  # let go of: dropped
        assert client.texts == [[("a", None)], [("b", None)]]
        assert logged == [("client disconnected", 2)]

    asyncio.run(scenario())
