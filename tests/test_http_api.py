"""The OpenAI-compatible HTTP API over a LocalBackend (tiny random Llama on CPU): bad input gets
a clear 4xx with an OpenAI error body, outputs match the offline engine token for token, streams
match non-streamed answers, and a client that goes away frees its request's KV."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest
from conftest import TINY_BACKEND_MODEL as MODEL
from fastapi.testclient import TestClient
from tiny_models import byte_tokenizer

from cluster.control.local_backend import LocalBackend
from cluster.frontend.backend import BackendError, GenerationBackend, TokenDelta, make_usage
from cluster.frontend.openai_api import BackgroundServer, create_app
from engine import LLM, SamplingParams

CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(backend):
    with TestClient(create_app(backend)) as client:
        yield client


def post(client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def sse_payloads(text: str) -> list:
    """The data of each SSE event; [DONE] stays a string."""
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-200:]
    return [json.loads(e) if e != "[DONE]" else e for e in events]


def slow_steps(monkeypatch, backend: LocalBackend, seconds: float = 0.02) -> None:
    """Make each engine step take a while, so a long request is surely still running."""
    step = backend.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(backend.engine, "step", slow_step)


def aborted_count(backend: LocalBackend) -> int:
    return asyncio.run(backend.health())["nodes"][0]["aborted"]


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- bad input ---------------------------------------------------------------------------

LONG_PROMPT = list(range(3, 303))  # 300 tokens > the 256-token context

BAD_REQUESTS = [
    ("completions", {"prompt": "x", "max_tokens": "abc"}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 100000}, 400, "context length"),
    ("completions", {"prompt": LONG_PROMPT, "max_tokens": 4}, 400, "context length"),
    ("completions", {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n: Input should be greater than"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("completions", {"prompt": ["a", ""]}, 400, "prompt[1]"),
    ("completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias keys"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"999": 1}}, 400, "logit_bias keys"),
    ("completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("completions", {"prompt": ""}, 400, "at least 1 character"),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("chat/completions", {"messages": []}, 400, "at least 1 item"),
    ("chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("chat/completions", {"messages": CHAT, "max_tokens": "abc"}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "model": "gpt-9"}, 404, "gpt-9"),
    ("chat/completions", {"messages": CHAT, "n": 129}, 400, "n: Input should be less than"),
    ("chat/completions", {"messages": CHAT, "frequency_penalty": 3}, 400, "frequency_penalty"),
    ("chat/completions", {"messages": CHAT, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("chat/completions", {"messages": [{"role": "user", "content": "y" * 300}]}, 400, "context"),
]


@pytest.mark.parametrize("path, body, status, needle", BAD_REQUESTS)
def test_bad_request_gets_openai_error(client, path, body, status, needle):
    response = client.post(f"/v1/{path}", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert needle in error["message"]
    if status == 404:
        assert error["code"] == "model_not_found" and error["param"] == "model"


def test_malformed_json_is_a_400(client):
    response = client.post(
        "/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_unknown_route_has_openai_error_body(client):
    response = client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert "message" in response.json()["error"]


# ---- answers -----------------------------------------------------------------------------


def test_completion_matches_offline_engine(client, tiny_llm):
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 24, "temperature": 0}
    answer = post(client, "/v1/completions", body)
    [reference] = tiny_llm.generate("Hello world", SamplingParams(max_tokens=24, temperature=0))
    choice = answer["choices"][0]
    assert answer["object"] == "text_completion" and answer["model"] == MODEL
    assert choice["token_ids"] == reference.token_ids
    assert choice["text"] == reference.text
    assert choice["finish_reason"] == reference.finish_reason
    # What the backend's prefix cache held of the prompt depends on what it served before.
    cached = answer["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert 0 <= cached < len(reference.prompt_token_ids)
    assert answer["usage"] == {
        "prompt_tokens": len(reference.prompt_token_ids),
        "completion_tokens": len(reference.token_ids),
        "total_tokens": len(reference.prompt_token_ids) + len(reference.token_ids),
    }


def test_chat_matches_offline_engine(client, backend, tiny_llm):
    answer = post(
        client,
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 20, "seed": 1, "temperature": 0},
    )
    prompt = backend.apply_chat_template(CHAT)
    [reference] = tiny_llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0))
    choice = answer["choices"][0]
    assert answer["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": reference.text}
    assert choice["token_ids"] == reference.token_ids
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["completion_tokens"] == len(reference.token_ids)


def test_stop_string_cuts_the_text_like_the_engine(client, tiny_llm):
    [free] = tiny_llm.generate("Hello", SamplingParams(max_tokens=40, temperature=0))
    stop = free.text[10:12]  # a piece the greedy answer is sure to produce
    params = SamplingParams(max_tokens=40, temperature=0, stop=[stop])
    [reference] = tiny_llm.generate("Hello", params)
    body = {"prompt": "Hello", "max_tokens": 40, "temperature": 0, "stop": [stop]}
    choice = post(client, "/v1/completions", body)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == reference.text and stop not in choice["text"]
    assert choice["token_ids"] == reference.token_ids


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_stream_concatenates_to_the_non_streamed_answer(client, path):
    body = {"max_tokens": 30, "temperature": 0, "stop": "zz"}
    body |= {"prompt": "Once upon"} if path == "completions" else {"messages": CHAT}
    whole = post(client, f"/v1/{path}", body)
    response = client.post(
        f"/v1/{path}", json=body | {"stream": True, "stream_options": {"include_usage": True}}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    *chunks, usage_chunk, done = sse_payloads(response.text)
    choices = [c["choices"][0] for c in chunks]
    if path == "completions":
        text = "".join(c["text"] for c in choices)
        expected = whole["choices"][0]["text"]
    else:
        assert choices[0]["delta"]["role"] == "assistant"
        text = "".join(c["delta"]["content"] for c in choices)
        expected = whole["choices"][0]["message"]["content"]
    assert text == expected
    assert sum((c["token_ids"] for c in choices), []) == whole["choices"][0]["token_ids"]
    assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == whole["choices"][0]["finish_reason"]
    # The streamed request reads the prompt the first one left in the prefix cache.
    streamed_details = usage_chunk["usage"].pop("prompt_tokens_details")
    whole_details = whole["usage"].pop("prompt_tokens_details")
    assert streamed_details["cached_tokens"] >= whole_details["cached_tokens"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]


def test_logprobs_when_asked(client):
    body = {"messages": CHAT, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    choice = post(client, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == 5
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in content)
    plain = post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5})
    assert plain["choices"][0]["logprobs"] is None

    body = {"prompt": "Hi", "max_tokens": 4, "logprobs": 3, "temperature": 0}
    logprobs = post(client, "/v1/completions", body)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 4
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"])


def test_models_and_health(client, backend):
    assert isinstance(backend, GenerationBackend)
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["nodes"][0]["name"] == "local"


def test_one_log_line_per_request(client, caplog):
    with caplog.at_level(logging.INFO, logger="cluster.frontend.openai_api"):
        post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0})
    lines = [r.getMessage() for r in caplog.records if r.name == "cluster.frontend.openai_api"]
    assert len(lines) == 2 and "finish=length" in lines[0] and "400" in lines[1]


def test_api_key_is_enforced_except_on_health(backend):
    with TestClient(create_app(backend, api_key="secret")) as client:
        body = {"prompt": "Hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
            response = client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models").status_code == 401
        good = {"Authorization": "Bearer secret"}
        assert client.post("/v1/completions", json=body, headers=good).status_code == 200
        assert client.get("/health").status_code == 200


# ---- backend failures and disconnects ----------------------------------------------------


class ScriptedBackend:
    """A GenerationBackend that plays back a fixed list of deltas and errors."""

    model_name = "scripted"
    max_model_len = 64

    def __init__(self, script: list, health_status: str = "ok") -> None:
        self.tokenizer = byte_tokenizer()
        self.script = script
        self.health_status = health_status

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(messages[-1]["content"])

    def validate(self, prompt_token_ids, params) -> None:
        pass

    async def generate(self, request_id, prompt_token_ids, params):
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield item

    async def health(self) -> dict:
        return {"status": self.health_status, "nodes": []}


DECODE_DOWN = BackendError(
    "decode node stopped answering", stage="decode", node="decode-1", status=503
)


def test_backend_error_before_first_token_is_its_status(client):
    app = TestClient(create_app(ScriptedBackend([DECODE_DOWN])))
    for stream in (False, True):
        response = app.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert "decode-1" in message and "decode" in message and "stopped answering" in message


def test_backend_error_mid_stream_is_a_final_error_event():
    script = [TokenDelta([72], "H"), DECODE_DOWN]
    app = TestClient(create_app(ScriptedBackend(script)))
    response = app.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    assert response.status_code == 200
    first, error, done = sse_payloads(response.text)
    assert first["choices"][0]["delta"]["content"] == "H"
    assert "decode-1" in error["error"]["message"] and error["error"]["code"] == 503


def test_extra_usage_statistics_pass_through_and_health_reports_status():
    usage = make_usage(2, 1, completion_tokens_details={"accepted_draft_tokens": 0})
    script = [TokenDelta([72], "H", finish_reason="stop", usage=usage)]
    app = TestClient(create_app(ScriptedBackend(script, health_status="degraded")))
    answer = post(app, "/v1/completions", {"prompt": "Hi"})
    assert answer["usage"] == usage
    assert app.get("/health").status_code == 503


class HangingBackend(ScriptedBackend):
    """Sends one delta, then never another; like a remote backend, its cleanup awaits."""

    def __init__(self) -> None:
        super().__init__([])
        self.cleaned_up = threading.Event()

    async def generate(self, request_id, prompt_token_ids, params):
        try:
            yield TokenDelta([72], "H")
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.01)  # e.g. sending an abort message to a node
            self.cleaned_up.set()


def test_disconnect_runs_a_backend_cleanup_that_awaits():
    body = {"prompt": "Hi", "max_tokens": 5}
    for stream in (True, False):
        backend = HangingBackend()
        with BackgroundServer(create_app(backend)) as server:
            with httpx.Client(base_url=server.url) as http:
                if stream:
                    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                        next(line for line in r.iter_lines() if line.startswith("data:"))
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        http.post("/v1/completions", json=body, timeout=0.3)
            assert backend.cleaned_up.wait(timeout=5), f"no cleanup (stream={stream})"


def test_client_disconnect_mid_stream_aborts_and_frees_kv(backend, monkeypatch):
    slow_steps(monkeypatch, backend)  # 200 tokens would take about 4 s
    assert wait_until(backend.engine.kv_cache.is_empty)
    aborted_before = aborted_count(backend)
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with BackgroundServer(create_app(backend)) as server, httpx.Client(base_url=server.url) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            next(line for line in response.iter_lines() if line.startswith("data:"))
            assert not backend.engine.kv_cache.is_empty()
        # Leaving the block closes the connection with the answer half read.
        aborted = wait_until(backend.engine.kv_cache.is_empty, timeout=2.0)
    assert aborted, "the request kept its KV after its client left"
    assert aborted_count(backend) == aborted_before + 1


def test_close_ends_running_requests_with_abort_and_refuses_new_ones(tiny_model_path):
    llm = LLM(str(tiny_model_path), device="cpu", max_model_len=256, kv_cache_tokens=2048)
    backend = LocalBackend(llm)
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run() -> list[TokenDelta]:
        deltas = []
        async for delta in backend.generate("r1", [5, 6, 7], params):
            deltas.append(delta)
            if len(deltas) == 2:
                backend.close()  # joins the engine thread, which answers r1 first
        with pytest.raises(BackendError) as caught:
            await anext(backend.generate("r2", [5, 6, 7], params))
        assert caught.value.status == 503
        return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].finish_reason == "abort" and len(deltas) < 200
    assert deltas[-1].usage["completion_tokens"] == sum(len(d.token_ids) for d in deltas)
    assert llm.engine.kv_cache.is_empty()
