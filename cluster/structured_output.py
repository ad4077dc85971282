"""OpenAI's structured output fields: `response_format` (json_object, json_schema) and `tools`
with `tool_choice`, turned into the grammar a request carries (engine.grammar), the tools'
description the prompt carries, and tool calls read back from the answer.

The default model's chat template has no tool format, so tools use a JSON envelope: a call is
the object {"name": <function>, "arguments": {...}}. `tool_choice` "required" constrains the
answer to a call of any declared function, a named function to a call of that one; "auto"
leaves the answer free and returns a call when the answer is one."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import RequestRejectedError
from engine.grammar import json_schema_grammar

FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: FunctionName
    description: str | None = None
    # `schema` is a BaseModel attribute: kept under another name, read from "schema".
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionSpec(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def response_format_grammar(response_format: ResponseFormat | None) -> str | None:
    """The grammar `response_format` asks for, None for plain text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return json_schema_grammar(None, "response_format")
    spec = response_format.json_schema
    if spec is None:
        raise RequestRejectedError(
            'response_format of type "json_schema" needs a json_schema', "response_format"
        )
    schema = spec.json_schema if spec.json_schema is not None else {}
    return json_schema_grammar(schema, "response_format.json_schema")


class ToolUse:
    """The tools of one chat request and how the answer must use them."""

    def __init__(self, tools: list[Tool], choice: ToolChoice | None) -> None:
        self.functions = {tool.function.name: tool.function for tool in tools}
        # OpenAI's default: "auto" when tools are given.
        self.choice = choice if choice is not None else "auto"
        if isinstance(self.choice, NamedToolChoice) and self.choice.function.name not in (
            self.functions
        ):
            raise RequestRejectedError(
                f"tool_choice names the function {self.choice.function.name!r}, "
                "which is not among tools",
                "tool_choice",
            )

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    def grammar(self) -> str | None:
        """A call of the named function, or of any declared one ("required"); None for
        "auto" and "none"."""
        if not self.active or self.choice == "auto":
            return None
        names = (
            [self.choice.function.name]
            if isinstance(self.choice, NamedToolChoice)
            else list(self.functions)
        )
        calls = [_call_schema(name, self.functions[name].parameters) for name in names]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return json_schema_grammar(schema, "tools")

    def system_prompt(self) -> str:
        """What the model is told about the tools (the template has no tool format)."""
        described = [
            {
                "name": f.name,
                "description": f.description or "",
                "parameters": f.parameters or {"type": "object"},
            }
            for f in self.functions.values()
        ]
        return (
            "You can call these functions. To call one, answer with only a JSON object "
            '{"name": <function name>, "arguments": <arguments object>}.\n'
            f"Functions: {json.dumps(described)}"
        )

    def tool_calls(self, text: str) -> list[dict[str, Any]] | None:
        """The answer as OpenAI tool calls when it is a call of a declared function."""
        if not self.active:
            return None
        try:
            call = json.loads(text)
        except ValueError:
            return None
        if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            return None
        if call["name"] not in self.functions or not isinstance(call["arguments"], dict):
            return None
        function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}]


def _call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            "arguments": parameters if parameters is not None else {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def with_tools_prompt(messages: list[dict[str, str]], tools: ToolUse) -> list[dict[str, str]]:
    """The conversation with the tools described in its system message."""
    if not tools.active:
        return messages
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + tools.system_prompt()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": tools.system_prompt()}, *messages]
