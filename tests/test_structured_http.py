"""Structured output through the HTTP API (the official `openai` client), on the default model:
response_format json_object and json_schema, tools with tool_choice required, a named function
and auto, tool calls in OpenAI's shape (streamed too); the fields' refusals; and the same over
a disaggregated cluster with speculation, whose prefill node samples the first token under the
grammar and whose decode node goes on from there."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from cluster.frontend.openai_api import BackgroundServer, create_app
from engine import LLM

pytest.importorskip("llguidance")

MODEL = "default"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON."}]


def _schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }


def _check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.fixture(scope="module")
def server():
    from cluster.control.local_backend import LocalBackend

    backend = LocalBackend(LLM(device="cpu", max_model_len=512), model_name=MODEL)
    with BackgroundServer(create_app(backend)) as server:
        yield server
    backend.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def test_the_python_client_returns_tool_calls_streamed_or_not(server):
    from cluster.client import Client

    ask = dict(max_tokens=48, temperature=0, tools=[WEATHER], tool_choice="required")
    with Client(server.url) as sdk:
        called = sdk.chat(ASK_WEATHER, **ask)
        assert called.finish_reason == "tool_calls" and called.text == ""
        [call] = called.tool_calls
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"]
        )
        chunks = list(sdk.chat(ASK_WEATHER, stream=True, **ask))
        assert chunks[-1].finish_reason == "tool_calls"
        assert chunks[-1].tool_calls[0]["function"] == call["function"]
        person = sdk.chat(
            ASK_PERSON,
            max_tokens=48,
            temperature=0,
            n=2,
            seed=2,
            response_format=_schema_format(PERSON),
        )
        for choice in person.choices:
            jsonschema.validate(json.loads(choice.text), PERSON)


def test_json_schema_answers_validate(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK_PERSON,
        max_tokens=48,
        temperature=0.7,
        seed=3,
        n=3,
        response_format=_schema_format(PERSON),
    )
    assert len(answer.choices) == 3
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_answer_is_an_object(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK_PERSON,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    # Any object is allowed, so a long one may run out of tokens: then it is one cut short.
    choice = answer.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_completions_take_response_format(client):
    answer = client.completions.create(
        model=MODEL,
        prompt="A person, as JSON:",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": _schema_format(PERSON)},
    )
    jsonschema.validate(json.loads(answer.choices[0].text), PERSON)


def test_required_tool_call_parses_into_the_declared_functions_arguments(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        max_tokens=48,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice="required",
    )
    [choice] = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_named_tool_call_and_its_stream(client):
    ask = dict(
        model=MODEL,
        messages=ASK_WEATHER,
        max_tokens=48,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    answer = client.chat.completions.create(**ask)
    [call] = answer.choices[0].message.tool_calls
    arguments = _check_call(call, TIME)
    chunks = list(client.chat.completions.create(stream=True, **ask))
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing[-1].choices[0].finish_reason == "tool_calls"
    [streamed] = finishing[-1].choices[0].delta.tool_calls
    assert streamed.index == 0 and streamed.function.name == "get_time"
    assert json.loads(streamed.function.arguments) == arguments
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)


def test_auto_answers_text_or_a_call(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=16,
        temperature=0,
        tools=[WEATHER],
    )
    choice = answer.choices[0]
    if choice.message.tool_calls:
        _check_call(choice.message.tool_calls[0], WEATHER)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


def test_tool_history_reaches_the_prompt(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[
            *ASK_WEATHER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
        ],
        max_tokens=8,
        temperature=0,
        tools=[WEATHER],
        tool_choice="none",
    )
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def _weather_call(call_id: str, city: str) -> dict:
    arguments = json.dumps({"city": city, "unit": "celsius"})
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


# An earlier answer with two calls shows the model the array envelope.
ASK_TWICE = [
    {"role": "user", "content": "What is the weather in Rome and in Berlin?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [_weather_call("call_1", "Rome"), _weather_call("call_2", "Berlin")],
    },
    {"role": "user", "content": "Now call get_weather twice: for Paris and for London."},
]


def test_an_answer_may_call_several_tools_unless_parallel_tool_calls_is_false(client):
    ask = dict(
        model=MODEL,
        messages=ASK_TWICE,
        max_tokens=80,
        temperature=0.7,
        seed=3,
        n=4,
        tools=[WEATHER, TIME],
        tool_choice="required",
    )
    answer = client.chat.completions.create(**ask)
    counts = []
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert len({call.id for call in calls}) == len(calls)
        for call in calls:
            _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
        counts.append(len(calls))
    assert max(counts) >= 2, counts
    single = client.chat.completions.create(**ask, parallel_tool_calls=False)
    assert [len(c.message.tool_calls) for c in single.choices] == [1] * 4


def test_a_complete_answer_ends_before_min_tokens(client):
    """The grammar wins over min_tokens: once the JSON is complete the answer ends, with the
    tokens it has without min_tokens (engine.sampling.grammar_mask)."""
    for fields in (
        {"response_format": _schema_format(PERSON), "messages": ASK_PERSON},
        {"tools": [WEATHER], "tool_choice": "required", "messages": ASK_WEATHER},
    ):
        ask = dict(model=MODEL, max_tokens=64, temperature=0, **fields)
        free = client.chat.completions.create(**ask)
        bounded = client.chat.completions.create(**ask, extra_body={"min_tokens": 60})
        [choice], [free_choice] = bounded.choices, free.choices
        assert choice.finish_reason == free_choice.finish_reason != "length"
        assert choice.model_extra["token_ids"] == free_choice.model_extra["token_ids"]
        assert bounded.usage.completion_tokens == free.usage.completion_tokens < 60
        if choice.message.tool_calls:
            _check_call(choice.message.tool_calls[0], WEATHER)
        else:
            jsonschema.validate(json.loads(choice.message.content), PERSON)


NOTE = {
    "type": "function",
    "function": {
        "name": "write_note",
        "description": "Write down a long note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}},  # no maxLength
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}
ASK_NOTE = [{"role": "user", "content": "Write a long note about the history of Paris."}]


def _streamed(client, ask: dict) -> tuple[str, str | None, list]:
    """A stream's text, its finish reason and the tool calls of its chunks."""
    choices = [c.choices[0] for c in client.chat.completions.create(stream=True, **ask)]
    text = "".join(choice.delta.content or "" for choice in choices)
    reasons = [choice.finish_reason for choice in choices if choice.finish_reason]
    calls = [choice.delta.tool_calls for choice in choices if choice.delta.tool_calls]
    assert len(reasons) == 1
    return text, reasons[0], calls


def test_an_unbounded_string_that_runs_into_max_tokens_is_text_cut_short(client):
    ask = dict(model=MODEL, messages=ASK_NOTE, max_tokens=12, temperature=0)
    for fields in (
        {"tools": [NOTE], "tool_choice": "required"},
        {"tools": [NOTE], "tool_choice": {"type": "function", "function": {"name": "write_note"}}},
        {"response_format": _schema_format(NOTE["function"]["parameters"])},
    ):
        answer = client.chat.completions.create(**ask, **fields)
        [choice] = answer.choices
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        assert answer.usage.completion_tokens == 12
        with pytest.raises(ValueError):
            json.loads(choice.message.content)
        assert _streamed(client, {**ask, **fields}) == (choice.message.content, "length", [])


def test_a_call_cut_by_max_tokens_where_its_json_closes_is_not_a_call(client):
    """max_tokens one short of the end of the answer: the text is the whole call, which the
    model had not ended (its end-of-sequence was the next token): text, finish "length"."""
    ask = dict(model=MODEL, messages=ASK_WEATHER, temperature=0, tools=[WEATHER])
    ask["tool_choice"] = "required"
    whole = client.chat.completions.create(**ask, max_tokens=48)
    assert whole.choices[0].finish_reason == "tool_calls"
    tokens = whole.choices[0].model_extra["token_ids"]
    cut = client.chat.completions.create(**ask, max_tokens=len(tokens) - 1)
    [choice] = cut.choices
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    arguments = json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    assert json.loads(choice.message.content) == {"name": "get_weather", "arguments": arguments}
    streamed = _streamed(client, {**ask, "max_tokens": len(tokens) - 1})
    assert streamed == (choice.message.content, "length", [])


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": _schema_format({"type": "object", "minProperties": "x"})},
            "response_format.json_schema",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_refusals_name_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=4, **fields)
    assert caught.value.body["param"] == param


def test_completions_refuse_tools(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=4, extra_body={"tools": [WEATHER]}
        )
    assert caught.value.body["param"] == "tools"


def test_without_the_grammar_library_a_grammar_request_is_a_400(client, monkeypatch):
    import engine.sampling.grammar

    monkeypatch.setattr(engine.sampling.grammar, "llguidance", None)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=ASK_PERSON, max_tokens=4, response_format={"type": "json_object"}
        )
    assert caught.value.body["param"] == "response_format"
    assert "llguidance" in caught.value.body["message"]
    # Everything else is served as before.
    plain = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=4)
    assert plain.choices[0].message.content


@pytest.mark.slow
def test_disaggregated_cluster_with_speculation(tmp_path):
    """The prefill node masks the first token; the decode node's grammar goes on after it and
    masks each verified position: answers validate, and the accept length is reported."""
    pytest.importorskip("ray")
    from cluster_helpers import launch, serve

    from engine.loading.default_model import default_model_path
    from spec.default_draft import default_draft_path

    cluster = launch(
        str(default_model_path()),
        prefill=1,
        decode=1,
        speculative_algorithm="multi-layer-eagle",
        draft_model=str(default_draft_path()),
        max_model_len=512,
        kv_cache_tokens=4096,
    )
    server = serve(cluster)
    try:
        remote = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        model = remote.models.list().data[0].id
        answer = remote.chat.completions.create(
            model=model,
            messages=ASK_PERSON,
            max_tokens=48,
            temperature=0,
            response_format=_schema_format(PERSON),
        )
        for choice in answer.choices:
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        usage = answer.usage.model_extra
        assert usage["spec_verify_steps"] >= 1
        print(f"cluster structured output: accept length {usage['spec_accept_length']}")
        tool = remote.chat.completions.create(
            model=model,
            messages=ASK_WEATHER,
            max_tokens=48,
            temperature=0,
            tools=[WEATHER],
            tool_choice="required",
        )
        [call] = tool.choices[0].message.tool_calls
        _check_call(call, WEATHER)
    finally:
        server.stop()
        cluster.shutdown()
