"""The HTTP layer under hostile or odd input: no input gets a 500 (integers beyond what the wire
carries, lone UTF-16 surrogates, failures while building a request), tokenizing never blocks the
event loop, bodies over the size limit get a 413, unimplemented OpenAI fields are refused by
name, the API key is checked before any routing (trailing slashes included) and may come from a
file or the environment, and the OpenAPI schema says what the server answers."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest
from conftest import TINY_BACKEND_MODEL as MODEL
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import byte_tokenizer

from cluster.commands.cli import build_parser, main
from cluster.commands.cli_commands import serve_api_key
from cluster.deploy.config import DEFAULT_MAX_REQUEST_BYTES
from cluster.frontend.openai_api import BackgroundServer, create_app

CHAT = [{"role": "user", "content": "Hello there"}]
MiB = 1024 * 1024
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def client(backend):
    with TestClient(create_app(backend)) as client:
        yield client


def vocab_size(backend) -> int:
    return backend.engine.runner.model_config.vocab_size


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def post_raw(client, path: str, raw_json: bytes) -> httpx.Response:
    """JSON written by hand: json.dumps cannot write a lone surrogate as UTF-8."""
    headers = {"content-type": "application/json"}
    return client.post(f"/v1/{path}", content=raw_json, headers=headers)


# ---- 1. no 500 for any input -------------------------------------------------------------

OUT_OF_RANGE = [
    ("completions", {"prompt": "x", "seed": 2**64}, "seed"),
    ("completions", {"prompt": "x", "seed": 2**63}, "seed"),
    ("completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ("completions", {"prompt": "x", "top_k": 2**70}, "top_k"),
    ("completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "x", "max_tokens": 2**70}, "max_tokens"),
    ("completions", {"prompt": "x", "logprobs": 2**70}, "logprobs"),
    ("completions", {"prompt": [5, 2**70]}, "prompt[1]"),
    ("completions", {"prompt": "x", "prompt_embeds": [{"position": 2**70, "embedding": [0.0]}]},
     "prompt_embeds[0].position"),
    ("chat/completions", {"messages": CHAT, "seed": 2**64}, "seed"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 2**64},
     "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2**70},
     "top_logprobs"),
]  # fmt: skip


@pytest.mark.parametrize("path, body, param", OUT_OF_RANGE)
def test_integers_beyond_the_wire_are_a_400_naming_the_field(client, path, body, param):
    error = error_of(client.post(f"/v1/{path}", json=body))
    assert error["param"] == param and param.split("[")[0] in error["message"]


def test_integer_bounds_are_inclusive_and_top_k_minus_one_disables(client, backend):
    for extra in (
        {"seed": INT64_MAX},
        {"seed": -(2**63)},
        {"top_k": -1},
        {"top_k": vocab_size(backend)},
    ):
        body = {"prompt": "Hi", "max_tokens": 2, "temperature": 1.0} | extra
        assert client.post("/v1/completions", json=body).status_code == 200, extra


def test_top_k_above_the_vocabulary_is_refused(client, backend):
    body = {"prompt": "Hi", "max_tokens": 2, "top_k": vocab_size(backend) + 1}
    assert "top_k" in error_of(client.post("/v1/completions", json=body))["message"]


SURROGATES = [
    ("completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("completions", b'{"prompt": ["a\\udc00b"]}', "prompt[0]"),
    ("completions", b'{"prompt": "ab", "stop": "\\ud800"}', "stop"),
    ("completions", b'{"prompt": "ab", "stop": ["ok", "\\ud800"]}', "stop[1]"),
    (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "messages[0].content",
    ),
    (
        "chat/completions",
        b'{"messages": [{"role": "system", "content": "ok"}, '
        b'{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        "messages[1].content[0].text",
    ),
]


@pytest.mark.parametrize("path, raw_json, param", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, raw_json, param):
    error = error_of(post_raw(client, path, raw_json))
    assert error["param"] == param


class FailingBackend:
    """Builds requests with a tokenizer, template or validation that raises `error`: what a
    value the schema let through but a later step cannot take looks like."""

    model_name = "failing"
    max_model_len = 64

    def __init__(self, step: str, error: Exception) -> None:
        self.tokenizer = byte_tokenizer()
        self.step, self.error = step, error
        if step == "tokenize":
            self.tokenizer.encode = self.fail

    def fail(self, *args, **kwargs):
        raise self.error

    def apply_chat_template(self, messages):
        return self.fail() if self.step == "template" else self.tokenizer.encode("hi")

    def validate(self, prompt_token_ids, params):
        if self.step == "validate":
            self.fail()

    async def generate(self, request_id, prompt_token_ids, params):
        raise AssertionError("a request that failed to build must not reach generate")
        yield

    async def health(self):
        return {"status": "ok", "nodes": []}


@pytest.mark.parametrize(
    "step, path, body, needle",
    [
        ("tokenize", "completions", {"prompt": "hi"}, "tokenizing the prompt"),
        ("template", "chat/completions", {"messages": CHAT}, "chat template"),
        ("validate", "completions", {"prompt": "hi"}, "validating the request"),
    ],
)
@pytest.mark.parametrize("error", [ValueError("bad"), TypeError("bad"), OverflowError("bad")])
def test_a_failure_while_building_a_request_is_a_400_naming_the_step(
    step, path, body, needle, error
):
    with TestClient(create_app(FailingBackend(step, error))) as client:
        message = error_of(client.post(f"/v1/{path}", json=body))["message"]
    assert needle in message and "bad" in message


def local_address(response: httpx.Response) -> tuple:
    """The client's end of the connection that carried `response` (read while it is open)."""
    return response.extensions["network_stream"].get_extra_info("client_addr")


def test_a_bad_request_keeps_the_connection_for_the_next(backend):
    bad = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    good = {"messages": CHAT, "max_tokens": 2}
    with BackgroundServer(create_app(backend)) as server, httpx.Client(base_url=server.url) as http:
        first = post_raw(http, "chat/completions", bad)
        first_connection = local_address(first)
        second = http.post("/v1/chat/completions", json=good)
        assert first.status_code == 400 and second.status_code == 200, second.text
        # A 500 would have closed the connection: the second request would open another.
        assert local_address(second) == first_connection


def rejected_count(client) -> float:
    text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdcluster_request_failures_total":
                if sample.labels.get("kind") == "rejected":
                    return sample.value
    raise AssertionError("no rejected failures in /metrics")


def test_every_400_counts_once_as_rejected(client):
    before = rejected_count(client)
    bad = [
        {"prompt": "x", "seed": 2**64},  # the schema
        {"prompt": "x", "tools": [{"type": "function"}]},  # an unsupported field
        {"prompt": "x", "echo": True},  # a check of the HTTP layer
        {"prompt": "x" * 300, "max_tokens": 4},  # the backend's validate, counted by it
    ]
    for body in bad:
        assert client.post("/v1/completions", json=body).status_code == 400
    unreadable = [
        b'{"prompt": "a\\ud800"}',  # a lone surrogate
        b'{"prompt": ',  # not JSON
        b'{"prompt": "\xff\xfe"}',  # not UTF-8: FastAPI's own 400
        b"[1, 2]",  # not an object
        b"",  # no body
    ]
    for raw in unreadable:
        assert error_of(post_raw(client, "completions", raw)), raw
    assert rejected_count(client) == before + len(bad) + len(unreadable)


def test_a_body_over_the_limit_counts_as_rejected(backend):
    with TestClient(create_app(backend, max_request_bytes=1000)) as client:
        before = rejected_count(client)
        declared = client.post("/v1/completions", json={"prompt": "x" * 2000})
        headers = {"content-type": "application/json"}
        chunked = client.post("/v1/completions", content=chunked_body(100), headers=headers)
        assert declared.status_code == chunked.status_code == 413
        assert "content-length" not in chunked.request.headers
        assert rejected_count(client) == before + 2


# ---- 2. nothing heavy on the event loop; a body size limit ---------------------------------


def test_a_body_over_the_limit_is_a_413(backend):
    body = {"prompt": "x" * 2000, "max_tokens": 1}
    with TestClient(create_app(backend, max_request_bytes=1000)) as client:
        error = error_of(client.post("/v1/completions", json=body), 413)
        assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]
        small = {"prompt": "Hi", "max_tokens": 1}
        assert client.post("/v1/completions", json=small).status_code == 200


def chunked_body(pieces: int, piece_bytes: int = 50):
    """A JSON completion body sent in pieces, chunked (no Content-Length)."""
    yield b'{"max_tokens": 1, "prompt": "'
    for _ in range(pieces):
        yield b"y" * piece_bytes
    yield b'"}'


def test_a_chunked_body_is_counted_as_it_arrives(backend):
    app = create_app(backend, max_request_bytes=4000)
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url) as http:
        headers = {"content-type": "application/json"}
        over = http.post("/v1/completions", content=chunked_body(100), headers=headers)
        assert "content-length" not in over.request.headers
        assert error_of(over, 413)["code"] == "request_too_large"
        under = http.post("/v1/completions", content=chunked_body(2), headers=headers)
        assert under.status_code == 200, under.text
        assert under.json()["usage"]["prompt_tokens"] == 100  # every piece reached the app


def test_the_default_limit_is_the_documented_one():
    assert DEFAULT_MAX_REQUEST_BYTES == 8 * MiB
    args = build_parser().parse_args(["serve"])
    assert args.max_request_bytes is None  # run_serve then takes the ServeConfig default


@pytest.mark.slow  # tokenizing 8 MB with the tiny byte-level tokenizer takes seconds
def test_health_answers_while_a_huge_prompt_is_tokenized(backend, monkeypatch):
    """The tokenizer holds the big prompt until /health has answered: were tokenizing on the
    event loop, /health could only answer after it (the gate gives up after 30 s)."""
    big_prompt = "hello world " * 700_000  # about 8 MB
    tokenizing, health_answered = threading.Event(), threading.Event()
    encode = backend.tokenizer.encode

    def gated_encode(text, *args, **kwargs):
        if len(text) > MiB:
            tokenizing.set()
            health_answered.wait(timeout=30)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(backend.tokenizer, "encode", gated_encode)
    finished: list[tuple[str, int]] = []
    app = create_app(backend, max_request_bytes=16 * MiB)
    with BackgroundServer(app) as server:

        def send_big_prompt() -> None:
            body = {"prompt": big_prompt, "max_tokens": 1}
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
            finished.append(("big prompt", response.status_code))

        sender = threading.Thread(target=send_big_prompt)
        sender.start()
        assert tokenizing.wait(timeout=120)
        health = httpx.get(server.url + "/health", timeout=120)
        finished.append(("health", health.status_code))
        health_answered.set()
        sender.join(timeout=300)
    # 8.4 M tokens do not fit the 256-token context: refused once tokenized.
    assert finished == [("health", 200), ("big prompt", 400)]


# ---- 3. refuse what is not built -----------------------------------------------------------

# Chat serves these (tests/test_structured_http.py); completions refuse them by name.
CHAT_ONLY = [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("parallel_tool_calls", False),
]
UNSUPPORTED = [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("best_of", 3),
    ("best_of", True),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("service_tier", "flex"),
]

NEUTRAL = {
    "response_format": {"type": "text"},
    "tools": [],
    "tool_choice": "none",
    "parallel_tool_calls": True,
    "functions": [],
    "function_call": "none",
    "logit_bias": {},
    "best_of": 1,
    "modalities": ["text"],
    "service_tier": "auto",
    # Known and harmless: accepted without a warning.
    "user": "someone",
    "metadata": {"team": "a"},
    "store": False,
    "stream_options": {"include_usage": False},
}


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("field, value", UNSUPPORTED)
def test_an_unimplemented_field_is_refused_by_name(client, path, field, value):
    body = {"max_tokens": 2, field: value}
    body |= {"prompt": "Hi"} if path == "completions" else {"messages": CHAT}
    error = error_of(client.post(f"/v1/{path}", json=body))
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("field, value", CHAT_ONLY)
def test_tools_are_refused_by_name_on_completions(client, field, value):
    error = error_of(client.post("/v1/completions", json={"prompt": "Hi", field: value}))
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_neutral_values_and_harmless_fields_are_accepted_quietly(client, path, caplog):
    body = {"max_tokens": 2, "model": MODEL} | NEUTRAL
    body |= {"prompt": "Hi"} if path == "completions" else {"messages": CHAT}
    with caplog.at_level(logging.WARNING, logger="cluster.frontend.openai_api"):
        assert client.post(f"/v1/{path}", json=body).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_schema_lists_the_values_of_unimplemented_fields_that_pass(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    completion = schemas["CompletionRequest"]["properties"]
    for field, refused in UNSUPPORTED:
        for properties in (chat, completion):
            # As JSON: true is not the 1 of best_of.
            accepted = {json.dumps(value) for value in properties[field]["enum"]}
            assert "null" in accepted and json.dumps(refused) not in accepted
            if field in NEUTRAL:
                assert json.dumps(NEUTRAL[field]) in accepted
    for field, refused in CHAT_ONLY:
        accepted = {json.dumps(value) for value in completion[field]["enum"]}
        assert "null" in accepted and json.dumps(refused) not in accepted
    assert chat["prompt_embeds"]["enum"] == [None]
    assert completion["echo"]["enum"] == [False]


def test_prompt_embeds_in_chat_points_to_completions(client):
    body = {"messages": CHAT, "prompt_embeds": [{"position": 0, "embedding": [0.0]}]}
    error = error_of(client.post("/v1/chat/completions", json=body))
    assert error["param"] == "prompt_embeds" and "/v1/completions" in error["message"]


def test_an_unknown_field_is_ignored_with_a_warning(client, caplog):
    body = {"prompt": "Hi", "max_tokens": 2, "frobnicate": 1}
    with caplog.at_level(logging.WARNING, logger="cluster.frontend.openai_api"):
        assert client.post("/v1/completions", json=body).status_code == 200
    assert any("frobnicate" in r.getMessage() for r in caplog.records)


def test_a_logit_bias_key_that_is_no_token_id_is_refused_by_name(client):
    for key in ("abc", "-1", "1.5", "99999"):
        body = {"messages": CHAT, "logit_bias": {key: 1}}
        error = error_of(client.post("/v1/chat/completions", json=body))
        assert error["param"] == "logit_bias" and "logit_bias" in error["message"], key


# ---- 4. the API key ------------------------------------------------------------------------

KEY = {"Authorization": "Bearer secret"}


@pytest.fixture(scope="module")
def keyed(backend):
    app = create_app(backend, api_key="secret", metrics_require_api_key=True)
    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/"])
def test_the_key_is_checked_before_any_redirect(keyed, path):
    body = {"messages": CHAT, "max_tokens": 2}
    spoofed = {"Host": "evil.example"}
    response = keyed.post(path, json=body, headers=spoofed, follow_redirects=False)
    error = error_of(response, 401)
    assert error["code"] == "invalid_api_key" and "location" not in response.headers
    assert response.headers["www-authenticate"] == "Bearer"
    answer = keyed.post(path, json=body, headers=spoofed | KEY, follow_redirects=False)
    assert answer.status_code == 200, answer.text


def test_without_the_key_no_route_is_revealed(keyed):
    for method, path in (("GET", "/v1/nothing-here"), ("GET", "/v1/completions")):
        assert keyed.request(method, path).status_code == 401
    assert keyed.get("/v1/nothing-here", headers=KEY).status_code == 404


def test_a_non_ascii_authorization_header_is_a_401(keyed):
    headers = {"Authorization": "Bearer sécret".encode()}
    assert keyed.get("/v1/models", headers=headers).status_code == 401


def test_metrics_can_require_the_key_and_health_never_does(keyed, client):
    assert keyed.get("/metrics").status_code == 401
    assert keyed.get("/metrics", headers=KEY).status_code == 200
    assert keyed.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200  # open unless asked


def test_metrics_require_api_key_needs_a_key(backend):
    with pytest.raises(ValueError, match="api_key"):
        create_app(backend, metrics_require_api_key=True)


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_the_key_comes_from_one_of_flag_file_or_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("  from-file  \nsecond line\n")
    assert serve_api_key(serve_args("--api-key", "flag"), {}) == "flag"
    assert serve_api_key(serve_args("--api-key-file", str(key_file)), {}) == "from-file"
    assert serve_api_key(serve_args(), {"PDCLUSTER_API_KEY": "env"}) == "env"
    assert serve_api_key(serve_args(), {}) is None
    with pytest.raises(ValueError, match="one way"):
        serve_api_key(serve_args("--api-key", "flag"), {"PDCLUSTER_API_KEY": "env"})
    with pytest.raises(ValueError, match="one way"):
        serve_api_key(serve_args("--api-key", "a", "--api-key-file", str(key_file)), {})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        serve_api_key(serve_args("--api-key-file", str(empty)), {})
    with pytest.raises(ValueError, match="empty"):
        serve_api_key(serve_args(), {"PDCLUSTER_API_KEY": ""})


def test_serve_flags_reach_the_config_and_bad_ones_are_cli_errors(tmp_path, monkeypatch, capsys):
    import cluster.commands.serve

    served = []
    monkeypatch.setattr(cluster.commands.serve, "serve", served.append)
    monkeypatch.delenv("PDCLUSTER_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("secret\n")
    flags = ["--api-key-file", str(key_file), "--max-request-bytes", "1234"]
    assert main(["serve", *flags, "--metrics-require-api-key"]) == 0
    [config] = served
    assert (config.api_key, config.max_request_bytes) == ("secret", 1234)
    assert config.metrics_require_api_key

    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "API key file" in capsys.readouterr().err
    assert main(["serve", "--metrics-require-api-key"]) == 2
    assert "API key" in capsys.readouterr().err
    assert len(served) == 1


# ---- 5. smaller: 405, one model, the OpenAPI schema ----------------------------------------


@pytest.mark.parametrize(
    "method, path, allowed",
    [
        ("GET", "/v1/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", f"/v1/models/{MODEL}", "GET"),
        ("POST", "/health", "GET"),
        ("POST", "/metrics", "GET"),
    ],
)
def test_a_405_names_the_allowed_methods(client, method, path, allowed):
    response = client.request(method, path)
    error = error_of(response, 405)
    assert response.headers["allow"] == allowed
    assert method in error["message"] and allowed in error["message"]


def test_one_model_by_id(client, backend):
    card = client.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model"
    assert card == client.get("/v1/models").json()["data"][0]
    error = error_of(client.get("/v1/models/gpt-9"), 404)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]


def json_schema_of(response: dict) -> dict:
    return response["content"]["application/json"]["schema"]


def test_the_openapi_schema_says_what_the_server_answers(client):
    spec = client.get("/openapi.json").json()
    error_body = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, body in (
        ("/v1/completions", "Completion"),
        ("/v1/chat/completions", "ChatCompletion"),
    ):
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert json_schema_of(responses["400"]) == error_body
        assert json_schema_of(responses["200"]) == {"$ref": f"#/components/schemas/{body}"}
        assert "text/event-stream" in responses["200"]["content"]  # stream: true
    for path, operation in spec["paths"].items():
        for method, details in operation.items():
            assert "422" not in details["responses"], (method, path)
    metrics = spec["paths"]["/metrics"]["get"]["responses"]
    assert list(metrics["200"]["content"]) == ["text/plain"]
    assert json_schema_of(metrics["404"]) == error_body
    health = spec["paths"]["/health"]["get"]["responses"]
    assert {"200", "503"} <= set(health)  # 503 while a node is down or the server drains
    schemas = spec["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    prompt_forms = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert all(form.get("minLength", form.get("minItems")) == 1 for form in prompt_forms)
    # ... and the server agrees with it.
    assert error_of(client.post("/v1/chat/completions", json={"messages": []}))
    assert error_of(client.post("/v1/completions", json={"prompt": ""}))
    assert error_of(client.post("/v1/completions", json={"prompt": []}))
