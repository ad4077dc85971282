"""The Python client (sync and async) and the official `openai` package against a live server
(uvicorn on a free port, LocalBackend over a tiny random Llama)."""

from __future__ import annotations

import asyncio
import socket
import time

import openai
import pytest
from conftest import TINY_BACKEND_MODEL as MODEL

from cluster.client import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AsyncClient,
    Client,
    Completion,
    CompletionUsage,
)
from cluster.frontend.openai_api import BackgroundServer, create_app
from engine import SamplingParams

CHAT = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def server(backend):
    with BackgroundServer(create_app(backend)) as server:
        yield server


@pytest.fixture()
def client(server):
    with Client(server.url, timeout=30) as client:
        yield client


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_generate_matches_offline_engine(client, tiny_llm):
    answer = client.generate("Hello world", max_tokens=12, temperature=0)
    [reference] = tiny_llm.generate("Hello world", SamplingParams(max_tokens=12, temperature=0))
    assert isinstance(answer, Completion)
    assert answer.text == reference.text and answer.token_ids == reference.token_ids
    assert answer.finish_reason == "length" and answer.model == MODEL
    prompt_tokens = len(reference.prompt_token_ids)
    assert answer.usage == CompletionUsage(prompt_tokens, 12, prompt_tokens + 12, {})


def test_generate_stream_and_token_id_prompt(client):
    whole = client.generate([5, 6, 7], max_tokens=10, temperature=0)
    chunks = list(client.generate([5, 6, 7], max_tokens=10, temperature=0, stream=True))
    assert "".join(c.text for c in chunks) == whole.text
    assert sum((c.token_ids for c in chunks), []) == whole.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage == whole.usage


def test_chat_stream_concatenates_to_the_answer(client):
    whole = client.chat(CHAT, max_tokens=16, temperature=0, logprobs=1)
    assert len(whole.token_ids) == 16 and len(whole.logprobs["content"]) == 16
    chunks = list(client.chat(CHAT, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.text for c in chunks) == whole.text
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == whole.finish_reason
    assert chunks[-1].usage == whole.usage and whole.usage.completion_tokens == 16


def test_bad_request_raises_api_error(client):
    with pytest.raises(APIError) as caught:
        client.generate("Hi", max_tokens=0)
    assert caught.value.status == 400 and caught.value.param == "max_tokens"
    assert "max_tokens" in caught.value.message
    with pytest.raises(APIError) as caught:
        client.chat(CHAT, max_tokens=10_000, stream=True)  # refused before the stream starts
    assert caught.value.status == 400 and "context length" in caught.value.message


def test_unknown_model_is_404(server):
    with Client(server.url, model="gpt-9") as client, pytest.raises(APIError) as caught:
        client.generate("Hi")
    assert caught.value.status == 404


def test_models_and_health(client):
    assert [m["id"] for m in client.models()] == [MODEL]
    assert client.health()["status"] == "ok"


def test_unreachable_server_raises_connection_error():
    with Client(f"http://127.0.0.1:{closed_port()}", timeout=5) as client:
        with pytest.raises(APIConnectionError) as caught:
            client.generate("Hi")
    assert not isinstance(caught.value, APITimeoutError)


def test_timeout_raises_and_the_abandoned_request_is_aborted(server, backend, monkeypatch):
    step = backend.engine.step
    monkeypatch.setattr(backend.engine, "step", lambda: (time.sleep(0.02), step())[1])
    with Client(server.url, timeout=0.2) as client, pytest.raises(APITimeoutError):
        client.generate("Hi", max_tokens=200, ignore_eos=True)
    deadline = time.monotonic() + 3  # the full answer would take about 4 s
    while not backend.engine.kv_cache.is_empty():
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.02)


def test_api_key(backend):
    with BackgroundServer(create_app(backend, api_key="secret")) as server:
        with Client(server.url, api_key="secret") as client:
            assert client.generate("Hi", max_tokens=2).usage.completion_tokens == 2
        with Client(server.url, api_key="wrong") as client, pytest.raises(APIError) as caught:
            client.generate("Hi", max_tokens=2)
    assert caught.value.status == 401


def test_async_client(server):
    async def run() -> None:
        async with AsyncClient(server.url + "/v1") as client:
            whole = await client.chat(CHAT, max_tokens=12, temperature=0)
            stream = await client.chat(CHAT, max_tokens=12, temperature=0, stream=True)
            chunks = [chunk async for chunk in stream]
            assert "".join(c.text for c in chunks) == whole.text
            assert chunks[-1].usage == whole.usage
            completion = await client.generate("Hi", max_tokens=3, temperature=0)
            assert len(completion.token_ids) == 3
            assert [m["id"] for m in await client.models()] == [MODEL]
            with pytest.raises(APIError) as caught:
                await client.generate("Hi", temperature=-1)
            assert caught.value.status == 400 and "temperature" in caught.value.message
        async with AsyncClient(f"http://127.0.0.1:{closed_port()}") as client:
            with pytest.raises(APIConnectionError):
                await client.health()

    asyncio.run(run())


def test_official_openai_package(server):
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 10
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens

    completion = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0)
    assert completion.usage.completion_tokens == 5 and completion.choices[0].text is not None

    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=-1)
    assert "max_tokens" in str(caught.value)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-9", messages=CHAT)


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server, tiny_llm):
    prompts = ["Alpha", "Bravo charlie", "Delta", "Echo foxtrot golf"]

    async def run() -> list:
        async with AsyncClient(server.url) as client:
            calls = [client.generate(p, max_tokens=20, temperature=0) for p in prompts]
            return await asyncio.gather(*calls)

    answers = asyncio.run(run())
    references = tiny_llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    assert [a.token_ids for a in answers] == [r.token_ids for r in references]


def test_n_choices_match_the_offline_engine_streamed_or_not(client, tiny_llm):
    ask = dict(max_tokens=8, temperature=1.0, seed=5, n=3)
    whole = client.generate("Hello world", **ask)
    expected = tiny_llm.generate("Hello world", SamplingParams(**ask))
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.token_ids for c in whole.choices] == [o.token_ids for o in expected]
    assert whole.text == whole.choices[0].text and whole.token_ids == expected[0].token_ids
    assert whole.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    chunks = list(client.generate("Hello world", stream=True, **ask))
    for index, output in enumerate(expected):
        mine = [c for c in chunks if c.index == index]
        assert sum((c.token_ids for c in mine), []) == output.token_ids
        assert "".join(c.text for c in mine) == whole.choices[index].text
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage == whole.usage


def test_batched_prompts_give_prompt_major_choices(client, tiny_llm):
    prompts = ["Alpha", "Bravo charlie"]
    whole = client.generate(prompts, max_tokens=6, temperature=0, n=2)
    expected = tiny_llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, n=2))
    assert [c.token_ids for c in whole.choices] == [o.token_ids for o in expected]
    token_prompts = client.generate([[5, 6, 7], [8, 9]], max_tokens=4, temperature=0)
    assert len(token_prompts.choices) == 2


def test_chat_n_choices_async(server):
    async def run() -> None:
        async with AsyncClient(server.url) as client:
            whole = await client.chat(CHAT, max_tokens=6, temperature=0.9, seed=1, n=2)
            assert len(whole.choices) == 2
            stream = await client.chat(
                CHAT, max_tokens=6, temperature=0.9, seed=1, n=2, stream=True
            )
            chunks = [chunk async for chunk in stream]
            for choice in whole.choices:
                mine = [c for c in chunks if c.index == choice.index]
                assert "".join(c.text for c in mine) == choice.text

    asyncio.run(run())


def test_structured_output_fields_reach_the_server(client):
    pytest.importorskip("llguidance")
    schema = {"enum": ["yes", "no"]}
    answer = client.chat(
        CHAT,
        max_tokens=8,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert answer.text in ('"yes"', '"no"')
    # Tool calls through this client: tests/test_structured_http.py (the default model).
