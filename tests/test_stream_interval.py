"""A stream interval through the cluster: an aggregated replica that sends a request's tokens
once 7 are new streams, over HTTP, exactly what an engine streaming every token does (the
LocalBackend over the same model, interval 1): the same text and finish reason for greedy
requests whose stop strings straddle the frames, outputs whose multi-byte characters split
across frames, log-probabilities, parallel samples with a seed and a tool call, in fewer
chunks than tokens. A client that reads slowly gets the tokens that waited for it in fewer,
larger chunks, and the same answer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import math
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from cluster_helpers import launch_aggregated, serve, wait_for
from tiny_models import make_tiny_llama, save_chat_template
from transformers.convert_slow_tokenizer import bytes_to_unicode

from cluster.control.local_backend import LocalBackend
from cluster.frontend.openai_api import BackgroundServer, create_app
from engine import LLM

ray = pytest.importorskip("ray")

INTERVAL = 7
ENGINE = dict(max_model_len=512, kv_cache_tokens=4096, max_num_seqs=16)
PROMPTS = ["hello there", "the quick brown fox", "1 2 3 4", "Once upon", "zzz", "a", "x y z", "Hi"]
BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}
NUM_SPECIAL_TOKENS = 3  # the byte tokenizer's <unk>, <s>, </s>


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-stream-interval")
    make_tiny_llama(path)
    save_chat_template(path)
    return str(path)


@pytest.fixture(scope="module")
def cluster(tiny_model):
    # The replica's streams go through its stream worker, as on a GPU (a CPU keeps them in
    # the node by default): the answers below are the worker's too.
    cluster = launch_aggregated(
        tiny_model, replicas=1, stream_interval=INTERVAL, stream_worker=True, **ENGINE
    )
    server = serve(cluster)
    yield cluster, server
    server.stop()
    cluster.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The same model in one process, streaming every token."""
    backend = LocalBackend(LLM(tiny_model, device="cpu", **ENGINE))
    with BackgroundServer(create_app(backend)) as server:
        yield server.url, backend.tokenizer
    backend.close()


# --- reading streams ---


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list | None = None
    logprobs: list = field(default_factory=list)  # (token, logprob, top) per token
    text_offsets: list[int] = field(default_factory=list)  # completions' logprobs.text_offset
    chunk_sizes: list[int] = field(default_factory=list)  # tokens of each chunk that has some


def sse_events(body: bytes) -> list[dict]:
    """The chunks of an SSE body, which ends with [DONE]; an error event fails the test."""
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", body[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in chunk for chunk in chunks), chunks[-1]
    return chunks


def choices(chunks: list[dict]) -> dict[int, Choice]:
    """Each choice's stream, joined."""
    joined: dict[int, Choice] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            choice = joined.setdefault(c["index"], Choice())
            if "delta" in c:
                choice.text += c["delta"].get("content") or ""
                choice.tool_calls = c["delta"].get("tool_calls") or choice.tool_calls
            else:
                choice.text += c["text"]
            if c["token_ids"]:
                choice.token_ids += c["token_ids"]
                choice.chunk_sizes.append(len(c["token_ids"]))
            if c.get("logprobs"):
                lp = c["logprobs"]
                choice.logprobs += zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])
                choice.text_offsets += lp.get("text_offset") or []
            if c["finish_reason"] is not None:
                assert choice.finish_reason is None, "a choice finishes once"
                choice.finish_reason = c["finish_reason"]
    return joined


def stream(url: str, body: dict, path: str = "/v1/completions") -> dict[int, Choice]:
    response = httpx.post(url + path, json=body | {"stream": True}, timeout=120)
    assert response.status_code == 200, response.text
    return choices(sse_events(response.content))


def answer(url: str, body: dict) -> dict:
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    return choice


def assert_same(got: Choice, expected: Choice) -> None:
    assert got.text == expected.text
    assert got.finish_reason == expected.finish_reason
    assert got.token_ids == expected.token_ids


def output_bytes(tokenizer, token_ids: list[int]) -> list[tuple[int, int]]:
    """(position, byte) of each output token that is a byte (the model's vocabulary is larger
    than the tokenizer's: its other tokens decode to nothing)."""
    tokens = tokenizer.convert_ids_to_tokens(token_ids)
    return [
        (position, BYTE_OF_CHAR[token])
        for position, (token_id, token) in enumerate(zip(token_ids, tokens))
        if token_id >= NUM_SPECIAL_TOKENS and token in BYTE_OF_CHAR
    ]


def decoded(window: list[tuple[int, int]]) -> str | None:
    """The text of these bytes, if they are whole characters."""
    try:
        return bytes(byte for _, byte in window).decode()
    except UnicodeDecodeError:
        return None


def frame_bounds(num_tokens: int) -> list[int]:
    """Where a replica with the interval cuts an output into frames: after its first token,
    then every INTERVAL tokens (one token a step)."""
    return list(range(1, num_tokens, INTERVAL))


# --- the same answers ---


def stop_straddling_a_frame_bound(reference_url: str, tokenizer, prompt: str) -> str | None:
    """A stop string of the greedy output of `prompt` whose first characters come in one frame
    and whose last in the next, and which ends the output there."""
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
    token_ids = answer(reference_url, body)["token_ids"]
    data = output_bytes(tokenizer, token_ids)
    for bound in frame_bounds(len(token_ids))[1:]:
        after_bound = next((i for i, (position, _) in enumerate(data) if position >= bound), None)
        if after_bound is None:
            break
        for before, after in ((2, 2), (1, 2), (2, 1), (1, 1)):
            window = data[max(0, after_bound - before) : after_bound + after]
            stop = decoded(window)
            if not stop or window[0][0] >= bound or window[-1][0] < bound:
                continue
            stopped = answer(reference_url, body | {"stop": [stop]})
            ends_there = len(stopped["token_ids"]) == window[-1][0] + 1
            if stopped["finish_reason"] == "stop" and ends_there:
                return stop
    return None


def test_stop_strings_that_straddle_frames_end_the_text_where_the_reference_does(
    cluster, reference
):
    _, server = cluster
    reference_url, tokenizer = reference
    cases = 0
    for prompt in PROMPTS:
        stop = stop_straddling_a_frame_bound(reference_url, tokenizer, prompt)
        if stop is None:
            continue
        cases += 1
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": [stop]}
        [(_, expected)] = stream(reference_url, body).items()
        [(_, got)] = stream(server.url, body).items()
        assert expected.finish_reason == "stop" and stop not in expected.text
        assert_same(got, expected)
    assert cases >= 2, "too few outputs with a stop string across a frame's bound"


def multibyte_across_a_frame_bound(data: list[tuple[int, int]]) -> bool:
    """Whether a character of several bytes (tokens) of `output_bytes` has its first byte in
    one frame and its last in the next."""
    bounds = frame_bounds(data[-1][0] + 1) if data else []
    for i, (first, byte) in enumerate(data):
        window = data[i : i + utf8_length(byte)]
        if len(window) < 2 or decoded(window) is None:
            continue
        if any(first < bound <= window[-1][0] for bound in bounds):
            return True
    return False


def utf8_length(first_byte: int) -> int:
    """The bytes of the UTF-8 character that begins with `first_byte` (0: it begins none)."""
    for size, (low, high) in enumerate([(0x00, 0x7F), (0xC2, 0xDF), (0xE0, 0xEF), (0xF0, 0xF4)]):
        if low <= first_byte <= high:
            return size + 1
    return 0


def test_characters_split_across_frames_come_whole_as_the_reference_gives_them(cluster, reference):
    _, server = cluster
    reference_url, tokenizer = reference
    split = 0
    for seed in range(60):
        prompt = PROMPTS[seed % len(PROMPTS)]
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 1.0, "seed": seed}
        [(_, expected)] = stream(reference_url, body).items()
        if not multibyte_across_a_frame_bound(output_bytes(tokenizer, expected.token_ids)):
            continue
        split += 1
        [(_, got)] = stream(server.url, body).items()
        assert_same(got, expected)
        if split == 3:
            break
    assert split >= 2, "too few outputs with a character across a frame's bound"


def test_logprobs_are_the_references(cluster, reference):
    _, server = cluster
    reference_url, _ = reference
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "logprobs": 3}
    [(_, expected)] = stream(reference_url, body).items()
    [(_, got)] = stream(server.url, body).items()
    assert_same(got, expected)
    assert len(got.logprobs) == len(expected.logprobs) == 24
    for (token, logprob, top), (ref_token, ref_logprob, ref_top) in zip(
        got.logprobs, expected.logprobs
    ):
        assert token == ref_token
        assert logprob == pytest.approx(ref_logprob, abs=1e-5)
        assert top.keys() == ref_top.keys()
        assert list(top.values()) == pytest.approx(list(ref_top.values()), abs=1e-5)
    assert len(got.chunk_sizes) < 24
    # Where each token's text starts, whatever chunks carried the tokens: as a whole answer
    # counts it (the text of the tokens before it).
    assert got.text_offsets == expected.text_offsets
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert whole["choices"][0]["logprobs"]["text_offset"] == got.text_offsets
    starts = [0]
    for token, _, _ in got.logprobs[:-1]:
        starts.append(starts[-1] + len(token))
    assert got.text_offsets == starts


def test_parallel_samples_with_a_seed_are_the_references(cluster, reference):
    _, server = cluster
    reference_url, _ = reference
    body = {"prompt": PROMPTS[1], "n": 2, "seed": 42, "temperature": 1.0, "max_tokens": 30}
    body |= {"ignore_eos": True}
    expected = stream(reference_url, body)
    got = stream(server.url, body)
    assert sorted(got) == sorted(expected) == [0, 1]
    for index in (0, 1):
        assert_same(got[index], expected[index])
    assert got[0].token_ids != got[1].token_ids


# A small tool: the tools' description goes into the prompt, and the tiny model reads 512
# positions.
CITY = {
    "type": "function",
    "function": {
        "name": "city",
        "parameters": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 6}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
}


def test_a_tool_call_is_the_references(cluster, reference):
    pytest.importorskip("llguidance")
    _, server = cluster
    reference_url, _ = reference
    body = {
        "messages": [{"role": "user", "content": "A city?"}],
        "tools": [CITY],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 64,
        "temperature": 0,
    }
    [(_, expected)] = stream(reference_url, body, "/v1/chat/completions").items()
    [(_, got)] = stream(server.url, body, "/v1/chat/completions").items()
    assert expected.finish_reason == "tool_calls"
    assert_same(got, expected)

    def calls(choice: Choice) -> list:
        return [(c["index"], c["function"]) for c in choice.tool_calls]

    assert calls(got) == calls(expected)


def test_the_interval_sends_fewer_chunks_than_tokens(cluster, reference):
    _, server = cluster
    reference_url, _ = reference
    body = {"prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    [(_, expected)] = stream(reference_url, body).items()
    [(_, got)] = stream(server.url, body).items()
    assert_same(got, expected)
    sizes = got.chunk_sizes
    assert sum(sizes) == 40 and len(sizes) < 40
    # Each chunk is one or more of the replica's frames (its first token, then 7 at a time):
    # every chunk but the last ends where a frame ends.
    assert set(itertools.accumulate(sizes[:-1])) <= set(frame_bounds(40))


# --- a slow client ---

SLOW_WRITE_S = 0.4


def run_on_router_loop(router, coroutine, timeout_s: float):
    """Run `coroutine` on the event loop that serves `router` (its flights are woken there)."""
    result: concurrent.futures.Future = concurrent.futures.Future()

    async def run() -> None:
        try:
            result.set_result(await coroutine)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            result.set_exception(err)

    router.call_in_loop(asyncio.ensure_future, run())
    return result.result(timeout_s)


async def slow_client(app, body: dict) -> list[bytes]:
    """POST `body` to `app` (the ASGI callable) as a client that takes SLOW_WRITE_S to read
    each write; the bodies written."""
    content = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"test"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
    }
    requests = [{"type": "http.request", "body": content, "more_body": False}]
    done = asyncio.Event()
    writes: list[bytes] = []
    status: list[int] = []

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
            return
        writes.append(message["body"])
        if not message.get("more_body", False):
            done.set()
        elif message["body"]:
            await asyncio.sleep(SLOW_WRITE_S)

    await app(scope, receive, send)
    assert status == [200]
    return writes


def test_a_slow_client_gets_the_same_answer_in_fewer_larger_chunks(cluster):
    cluster_, server = cluster
    body = {"prompt": PROMPTS[2], "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    [(_, fast)] = stream(server.url, body).items()  # also starts the router's loop
    app = create_app(cluster_.router)
    writes = run_on_router_loop(cluster_.router, slow_client(app, body | {"stream": True}), 120)
    [(_, slow)] = choices(sse_events(b"".join(writes))).items()
    assert_same(slow, fast)
    assert fast.finish_reason == "length" and len(slow.token_ids) == 100
    assert len(slow.chunk_sizes) < len(slow.token_ids)
    frames = 1 + math.ceil((100 - 1) / INTERVAL)
    assert len(slow.chunk_sizes) < frames, "what waited for the client came as one chunk"


def _stream_worker_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"decode_node.stream_worker" in cmdline:
                pids.append(int(entry.name))
    return pids


def test_a_replica_whose_stream_worker_dies_is_replaced_and_serves_again(cluster):
    """Last: it replaces the module's replica. Its probe fails (the worker is gone), the
    cluster replaces it, and requests are answered again."""
    cluster_, server = cluster
    (worker,) = _stream_worker_pids()
    os.kill(worker, signal.SIGKILL)
    node = cluster_.router.decode_nodes[0]
    assert wait_for(lambda: node.restarts == 1 and node.alive, 120), node.error
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) == 8
    assert _stream_worker_pids() not in ([], [worker])
