"""OpenAI's structured output fields: `response_format` (json_object, json_schema) and `tools`
with `tool_choice`, turned into the grammar a request carries (engine.sampling.grammar), the tools'
description the prompt carries, and tool calls read back from the answer.

The default model's chat template has no tool format, so tools use a JSON envelope: a call is
the object {"name": <function>, "arguments": {...}}, and an answer with several calls is a JSON
array of such objects (allowed unless `parallel_tool_calls` is false). `tool_choice` "required"
constrains the answer to one or more calls of the declared functions, a named function to calls
of that one (exactly one call each when `parallel_tool_calls` is false); "auto" leaves the
answer free and returns its calls when the answer is calls.

Only an answer that ended on its own (finish_reason "stop") is read as calls: one cut short by
max_tokens is returned as the text it is, with finish_reason "length", even where the cut
happens to leave parseable JSON, since the model had not ended it there."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import RequestRejectedError
from engine.sampling.grammar import json_schema_grammar

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

    def __init__(
        self, tools: list[Tool], choice: ToolChoice | None, parallel: bool | None = None
    ) -> None:
        self.functions = {tool.function.name: tool.function for tool in tools}
        if len(self.functions) < len(tools):
            # The envelope names a call's function only: two of one name are not told apart.
            raise RequestRejectedError("tools declares a function name twice", "tools")
        # OpenAI's defaults: "auto" when tools are given, several calls allowed.
        self.choice = choice if choice is not None else "auto"
        self.parallel = parallel if parallel is not None else True
        if self.choice == "required" and not self.functions:
            raise RequestRejectedError(
                'tool_choice "required" needs at least one function in tools', "tool_choice"
            )
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
        """The grammar of `answer_schema`; None for "auto" and "none"."""
        schema = self.answer_schema()
        return None if schema is None else json_schema_grammar(schema, "tools")

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema of an answer that tool_choice forces to calls: calls of the named
        function, or of any declared one ("required"); a single call object, or (when
        parallel calls are allowed) also a non-empty array of them. None for "auto" and
        "none"."""
        if not self.active or self.choice == "auto":
            return None
        names = (
            [self.choice.function.name]
            if isinstance(self.choice, NamedToolChoice)
            else list(self.functions)
        )
        defs: dict[str, Any] = {}
        calls = [_call_schema(name, self.functions[name].parameters, defs) for name in names]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = (
            call
            if not self.parallel
            else {"anyOf": [call, {"type": "array", "items": call, "minItems": 1}]}
        )
        # Each function's own definitions, hoisted: its $refs point at the answer's root now.
        return {**schema, "$defs": defs} if defs else schema

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
        several = (
            " To call several at once, answer with only a JSON array of such objects."
            if self.parallel
            else ""
        )
        return (
            "You can call these functions. To call one, answer with only a JSON object "
            '{"name": <function name>, "arguments": <arguments object>}.'
            f"{several}\nFunctions: {json.dumps(described)}"
        )

    def tool_calls(self, text: str, finish_reason: str | None) -> list[dict[str, Any]] | None:
        """The answer as OpenAI tool calls, each with its own id, when it ended on its own
        and is calls of declared functions: one call object, or an array of them where
        parallel calls are allowed (an array of one always is)."""
        if not self.active or finish_reason != "stop":
            return None
        try:
            answer = json.loads(text)
        except ValueError:
            return None
        calls = answer if isinstance(answer, list) else [answer]
        if not calls or (len(calls) > 1 and not self.parallel):
            return None
        if not all(self._is_call(call) for call in calls):
            return None
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
            }
            for call in calls
        ]

    def _is_call(self, call: Any) -> bool:
        return (
            isinstance(call, dict)
            and set(call) == {"name", "arguments"}
            and call["name"] in self.functions
            and isinstance(call["arguments"], dict)
        )


def _call_schema(
    name: str, parameters: dict[str, Any] | None, defs: dict[str, Any]
) -> dict[str, Any]:
    """A call of `name` whose arguments follow `parameters`; the definitions the parameters
    refer to join `defs`, which the caller puts at the answer schema's root."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            "arguments": _hoist_definitions(name, parameters, defs),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _hoist_definitions(
    name: str, parameters: dict[str, Any] | None, defs: dict[str, Any]
) -> dict[str, Any]:
    """`parameters` as it reads nested under a call: JSON pointers in its `$ref`s start at the
    document's root, which is the answer schema now, not the parameters. So its `$defs` (or
    `definitions`, as pydantic and older drafts write) move to the root, named after the
    function, and its `$ref`s follow them; a `$ref` to the parameters themselves ("#", a
    recursive schema) points at a copy of them kept there too."""
    if parameters is None:
        return {"type": "object"}
    if "$ref" not in json.dumps(parameters):
        return parameters
    body = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    local = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}

    recursive = False

    def retarget(ref: str) -> str:
        nonlocal recursive
        for root in ("#/$defs/", "#/definitions/"):
            if ref.startswith(root):
                return f"#/$defs/{name}.{ref[len(root) :]}"
        recursive = recursive or ref == "#"
        return f"#/$defs/{name}" if ref == "#" else ref

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                key: retarget(value) if key == "$ref" and isinstance(value, str) else rewrite(value)
                for key, value in node.items()
            }
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        return node

    defs.update({f"{name}.{key}": rewrite(value) for key, value in local.items()})
    body = rewrite(body)
    if recursive:
        defs[name] = body
    return body


def with_tools_prompt(messages: list[dict[str, str]], tools: ToolUse) -> list[dict[str, str]]:
    """The conversation with the tools described in its system message."""
    if not tools.active:
        return messages
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + tools.system_prompt()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": tools.system_prompt()}, *messages]
