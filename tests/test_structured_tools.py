"""Tool calls and the grammar's limits, without a model: several calls in one answer (a JSON
array of call objects, each returned with its own id, streamed too) unless parallel_tool_calls
is false; no call read from an answer cut short by max_tokens; a complete grammar winning over
min_tokens in the mask; and the refusals of what is not built, each naming its field."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient
from tiny_models import byte_tokenizer

from cluster.frontend.backend import TokenDelta, make_usage
from cluster.frontend.openai_api import create_app
from cluster.frontend.request_schema import ChatMessage
from cluster.frontend.structured_output import Tool, ToolUse
from engine.sampling.grammar_mask import apply_bitmask, new_bitmask

pytest.importorskip("llguidance")


def _function(name: str, argument: str) -> dict:
    parameters = {
        "type": "object",
        "properties": {argument: {"type": "string", "maxLength": 20}},
        "required": [argument],
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


WEATHER = _function("get_weather", "city")
TIME = _function("get_time", "zone")
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
PARIS = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOKYO = {"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}
TWO_CALLS = json.dumps([PARIS, TOKYO])


def _called(calls: list[dict] | None) -> list[tuple[str, dict]]:
    assert calls is not None
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_an_answer_may_hold_several_calls_each_with_its_own_id():
    tools = ToolUse(TOOLS, "auto")
    calls = tools.tool_calls(TWO_CALLS, "stop")
    assert _called(calls) == [("get_weather", PARIS["arguments"]), ("get_time", TOKYO["arguments"])]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    paris = [("get_weather", {"city": "Paris"})]
    assert _called(tools.tool_calls(json.dumps(PARIS), "stop")) == paris
    assert _called(tools.tool_calls(json.dumps([PARIS]), "stop")) == paris


@pytest.mark.parametrize(
    "answer",
    [
        "[]",
        json.dumps([PARIS, {"name": "get_weather"}]),  # one malformed call spoils the answer
        json.dumps([PARIS, {"name": "launch", "arguments": {}}]),  # not a declared function
        json.dumps([PARIS, [TOKYO]]),
        "Paris is sunny.",
    ],
)
def test_an_answer_that_is_not_all_calls_is_text(answer):
    assert ToolUse(TOOLS, "auto").tool_calls(answer, "stop") is None


def test_without_parallel_tool_calls_an_answer_holds_one_call():
    tools = ToolUse(TOOLS, "auto", parallel=False)
    assert tools.tool_calls(TWO_CALLS, "stop") is None
    assert len(tools.tool_calls(json.dumps([PARIS]), "stop")) == 1
    assert "array" not in tools.system_prompt()
    assert "array" in ToolUse(TOOLS, "auto").system_prompt()


@pytest.mark.parametrize("finish_reason", ["length", "abort", None])
def test_an_answer_that_did_not_end_on_its_own_is_never_calls(finish_reason):
    """Cut by max_tokens where the JSON happens to close, the answer is still not calls."""
    tools = ToolUse(TOOLS, "required")
    assert tools.tool_calls(json.dumps(PARIS), finish_reason) is None
    assert tools.tool_calls(TWO_CALLS, finish_reason) is None


@pytest.mark.parametrize(
    ("choice", "parallel", "accepted", "refused"),
    [
        ("required", True, [PARIS, [PARIS], [PARIS, TOKYO]], [[], {"name": "x"}]),
        ("required", False, [PARIS, TOKYO], [[PARIS], [PARIS, TOKYO]]),
        (
            {"type": "function", "function": {"name": "get_time"}},
            True,
            [TOKYO, [TOKYO, TOKYO]],
            [PARIS, [TOKYO, PARIS]],
        ),
        ({"type": "function", "function": {"name": "get_time"}}, False, [TOKYO], [[TOKYO]]),
    ],
)
def test_forced_calls_one_or_more_when_parallel_exactly_one_when_not(
    choice, parallel, accepted, refused
):
    from cluster.frontend.structured_output import NamedToolChoice

    if isinstance(choice, dict):
        choice = NamedToolChoice.model_validate(choice)
    tools = ToolUse(TOOLS, choice, parallel)
    schema = tools.answer_schema()
    for answer in accepted:
        jsonschema.validate(answer, schema)
    for answer in refused:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(answer, schema)
    assert tools.grammar() is not None  # and it compiles


def test_earlier_calls_reach_the_prompt_in_the_envelope():
    def call(name: str, arguments: dict) -> dict:
        function = {"name": name, "arguments": json.dumps(arguments)}
        return {"id": "call_1", "type": "function", "function": function}

    one = ChatMessage(role="assistant", tool_calls=[call(**PARIS)])
    assert json.loads(one.text()) == PARIS
    two = ChatMessage(role="assistant", content=None, tool_calls=[call(**PARIS), call(**TOKYO)])
    assert json.loads(two.text()) == [PARIS, TOKYO]
    assert " " not in two.text().replace("Asia/Tokyo", "")  # as the grammar writes JSON


# ---- the grammar wins over min_tokens --------------------------------------------------------

EOS, DIGIT = 2, 5


def _allowed_tokens(*tokens: int, vocab: int = 64) -> torch.Tensor:
    bitmask = torch.zeros(1, new_bitmask(1, vocab).shape[1], dtype=torch.int32)
    for token in tokens:
        word, bit = divmod(token, 32)
        bitmask[0, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
    return bitmask


def test_a_complete_grammar_ends_the_answer_though_min_tokens_bans_its_end():
    raw = torch.randn(1, 64)
    processed = raw.clone()
    processed[0, EOS] = -torch.inf  # min_tokens not reached yet
    only_eos = _allowed_tokens(EOS)
    # Without the logits before the processors, no token is left: sampling would draw garbage.
    assert torch.isneginf(apply_bitmask(processed, only_eos)).all()
    masked = apply_bitmask(processed, only_eos, unprocessed=raw)
    assert torch.nonzero(masked[0] > -torch.inf).flatten().tolist() == [EOS]
    assert masked[0, EOS] == raw[0, EOS]


def test_min_tokens_holds_where_the_grammar_allows_more_than_the_end():
    raw = torch.randn(2, 64)
    processed = raw.clone()
    processed[:, EOS] = -torch.inf
    bitmask = torch.cat([_allowed_tokens(EOS, DIGIT), _allowed_tokens(EOS)])
    masked = apply_bitmask(processed, bitmask, unprocessed=raw)
    assert torch.nonzero(masked[0] > -torch.inf).flatten().tolist() == [DIGIT]
    assert torch.nonzero(masked[1] > -torch.inf).flatten().tolist() == [EOS]


# ---- through the HTTP API, with a backend that plays an answer back ------------------------


class AnsweringBackend:
    """Answers every request with `text`, a token per character, ending with `finish_reason`."""

    model_name = "scripted"
    max_model_len = 512

    def __init__(self, text: str, finish_reason: str = "stop") -> None:
        self.tokenizer = byte_tokenizer()
        self.text = text
        self.finish_reason = finish_reason

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(messages[-1]["content"])

    def validate(self, prompt_token_ids, params) -> None:
        pass

    async def generate(self, request_id, prompt_token_ids, params):
        for i, char in enumerate(self.text):
            last = i == len(self.text) - 1
            yield TokenDelta(
                [ord(char)],
                char,
                finish_reason=self.finish_reason if last else None,
                usage=make_usage(len(prompt_token_ids), len(self.text)) if last else None,
            )

    async def health(self) -> dict:
        return {"status": "ok", "nodes": []}


ASK = [{"role": "user", "content": "Weather in Paris, time in Tokyo?"}]


def _sse(text: str) -> list[dict]:
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_several_calls_are_returned_and_streamed_in_openai_shape(tool_choice):
    app = TestClient(create_app(AnsweringBackend(TWO_CALLS)))
    body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice}
    answer = app.post("/v1/chat/completions", json=body).json()
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert _called(calls) == [("get_weather", PARIS["arguments"]), ("get_time", TOKYO["arguments"])]
    assert len({c["id"] for c in calls}) == 2
    chunks = _sse(app.post("/v1/chat/completions", json=body | {"stream": True}).text)
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    [last] = [c for c in chunks if c["choices"][0]["finish_reason"]]
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    streamed = last["choices"][0]["delta"]["tool_calls"]
    assert [c["index"] for c in streamed] == [0, 1]
    assert len({c["id"] for c in streamed}) == 2
    assert _called(streamed) == _called(calls)


def test_with_parallel_tool_calls_false_several_calls_are_text():
    app = TestClient(create_app(AnsweringBackend(TWO_CALLS)))
    body = {"messages": ASK, "tools": [WEATHER, TIME], "parallel_tool_calls": False}
    [choice] = app.post("/v1/chat/completions", json=body).json()["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == TWO_CALLS
    assert choice["message"].get("tool_calls") is None


def test_the_python_client_takes_parallel_tool_calls_and_returns_every_call():
    from cluster.client import Client
    from cluster.frontend.openai_api import BackgroundServer

    ask = dict(tools=[WEATHER, TIME], tool_choice="required")
    with BackgroundServer(create_app(AnsweringBackend(TWO_CALLS))) as server:
        with Client(server.url) as sdk:
            answer = sdk.chat(ASK, **ask)
            assert answer.finish_reason == "tool_calls"
            assert _called(answer.tool_calls) == [
                ("get_weather", PARIS["arguments"]),
                ("get_time", TOKYO["arguments"]),
            ]
            last = list(sdk.chat(ASK, stream=True, **ask))[-1]
            assert [call["index"] for call in last.tool_calls] == [0, 1]
            single = sdk.chat(ASK, parallel_tool_calls=False, **ask)
            assert single.tool_calls is None and single.text == TWO_CALLS


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_text_with_finish_reason_length(stream):
    """Even where the cut leaves JSON that parses as a call, the model had not ended there."""
    app = TestClient(create_app(AnsweringBackend(json.dumps(PARIS), finish_reason="length")))
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "stream": stream}
    response = app.post("/v1/chat/completions", json=body)
    if stream:
        chunks = _sse(response.text)
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        finishing = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
        assert [c["finish_reason"] for c in finishing] == ["length"]
        assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    else:
        [choice] = response.json()["choices"]
        assert choice["finish_reason"] == "length" and choice["message"].get("tool_calls") is None
        content = choice["message"]["content"]
    assert content == json.dumps(PARIS)


# ---- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"response_format": {"type": "regex", "regex": "a+"}}, "response_format.type"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"structured_outputs": {"json": {}}}, "structured_outputs"),
        ({"structural_tag": "{}"}, "structural_tag"),
        ({"regex": "a+"}, "regex"),
        ({"ebnf": "root ::= 'a'"}, "ebnf"),
    ],
)
def test_structured_output_not_built_is_a_400_naming_the_field(fields, param):
    app = TestClient(create_app(AnsweringBackend("Hi")))
    response = app.post("/v1/chat/completions", json={"messages": ASK, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param.split(".")[0].split("[")[0] in error["message"]


ADDRESS_TOOL = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "ship",
            # As pydantic writes a model with nested models: definitions under $defs (and the
            # older "definitions"), referred to from the properties.
            "parameters": {
                "type": "object",
                "properties": {
                    "address": {"$ref": "#/$defs/Address"},
                    "tags": {"type": "array", "items": {"$ref": "#/definitions/Tag"}},
                    "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                },
                "required": ["address"],
                "$defs": {
                    "Address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 10}},
                        "required": ["city"],
                    }
                },
                "definitions": {"Tag": {"enum": ["fragile", "express"]}},
            },
        },
    }
)


def test_parameters_with_definitions_and_references_constrain_the_call():
    """A tool whose parameters refer to their own $defs: nested under the call, the references
    still resolve (the definitions move to the answer's root), so the grammar compiles and a
    call validates exactly as its arguments do against the parameters alone."""
    for parallel in (True, False):
        tools = ToolUse([ADDRESS_TOOL, TOOLS[0]], "required", parallel)
        assert tools.grammar() is not None
        schema = tools.answer_schema()
        good = {
            "name": "ship",
            "arguments": {
                "address": {"city": "Oslo"},
                "tags": ["express"],
                "next": {"address": {"city": "Bergen"}, "next": None},
            },
        }
        jsonschema.validate(good, schema)
        parameters = ADDRESS_TOOL.function.parameters
        for bad_arguments in (
            {"address": {}},
            {"address": {"city": "Oslo"}, "tags": ["slow"]},
            {"address": {"city": "Oslo"}, "next": {"address": {"town": "x"}}},
        ):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad_arguments, parameters)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate({"name": "ship", "arguments": bad_arguments}, schema)
    # The function without references is nested as it was given.
    plain = ToolUse(TOOLS, "required").answer_schema()
    assert "$defs" not in plain
