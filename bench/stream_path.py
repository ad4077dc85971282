"""The front end's per-step path alone: token frames delivered to STREAMS streams, each an SSE
response over the router's layers (flight, SharedPrefill, admission), whose chunks go to a send
that frames them as uvicorn does (no socket). Prints the CPU per token of writing each step's
chunks from the delivering call (`direct`, the server's own send in RAW_SEND) and of waking
each stream's task (`task`, no RAW_SEND).

    python bench/stream_path.py [--streams 64] [--steps 200] [--gap-s 0] [--repeats 2]

--gap-s puts that much idle time between steps, as a CPU engine's steps (6 to 11 a second)
do: the same path then runs cold."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.control.node_state import NodeState  # noqa: E402
from cluster.frontend.admission import Admission  # noqa: E402
from cluster.frontend.flights import Flight, FlightTable, next_delta, take_tokens  # noqa: E402
from cluster.frontend.protocol import ResponseFormatter  # noqa: E402
from cluster.frontend.sample_streams import SharedPrefill  # noqa: E402
from cluster.frontend.streaming import RAW_SEND, EventStreamResponse  # noqa: E402
from metadata.messages import StreamEnd, TokenFrame  # noqa: E402


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class Timer:
    def tokens(self, count: int) -> None:
        pass

    def finished(self, finish_reason: str, usage: dict) -> None:
        pass

    def failed(self, kind: str) -> None:
        pass


async def _no_news() -> None:
    return None


def framing_send(written: list[int]):
    """A send that frames a body as uvicorn's HTTP/1.1 chunked encoding does."""

    async def send(message: dict) -> None:
        body = message.get("body", b"")
        content = [b"%x\r\n" % len(body), body, b"\r\n"]
        if not message.get("more_body"):
            content.append(b"0\r\n\r\n")
        written[0] += len(b"".join(content))

    return send


async def run(direct: bool, streams: int, steps: int, gap_s: float) -> float:
    node = NodeState("replica", 0, _no_news)
    table = FlightTable()
    rooms = list(range(1, streams + 1))
    backend = SimpleNamespace(model_name="tiny", tokenizer=CharTokenizer())
    responses, written = [], [0]
    for room in rooms:
        flight = Flight(None, node, room, prompt_tokens=16, timer=Timer(), timeline=None)
        table.add(flight)

        async def open_flights(wanted: list[int], flight: Flight = flight) -> list[Flight]:
            return [flight]

        [stream] = SharedPrefill(
            1, open_flights, lambda f: next_delta(f, "prefill", None), table.end, take_tokens
        ).streams
        deltas = Admission().admit().watch(stream)
        table.deliver(TokenFrame([room], [1], [65], ["A"], [], []))
        first = await anext(deltas)
        formatter = ResponseFormatter("chat", "chatcmpl-1", backend, include_usage=False)
        response = EventStreamResponse(first, deltas, formatter, lambda *line: None)
        send = framing_send(written)
        scope = {"type": "http", RAW_SEND: send} if direct else {"type": "http"}
        stays = asyncio.Event()

        async def receive(stays: asyncio.Event = stays) -> dict:
            await stays.wait()
            return {"type": "http.disconnect"}

        responses.append(asyncio.ensure_future(response(scope, receive, send)))
    for _ in range(10):
        await asyncio.sleep(0)
    step = TokenFrame(rooms, [1] * streams, [66] * streams, ["b"] * streams, [], [])
    ends = [StreamEnd(entry, "length") for entry in range(streams)]
    last = TokenFrame(rooms, [1] * streams, [67] * streams, ["c"] * streams, [], ends)
    started = time.process_time()
    for _ in range(steps):
        table.deliver(step)
        await asyncio.sleep(gap_s)
        await asyncio.sleep(0)
    table.deliver(last)
    await asyncio.gather(*responses)
    return (time.process_time() - started) / (streams * (steps + 1)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gap-s", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    for _ in range(args.repeats):
        for direct in (False, True):
            us = asyncio.run(run(direct, args.streams, args.steps, args.gap_s))
            print(f"{'direct' if direct else 'task'}: {us:.2f} us/token (CPU)", flush=True)


if __name__ == "__main__":
    main()
