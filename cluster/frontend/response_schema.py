"""The bodies of successful answers, as the OpenAPI schema documents them.

cluster.frontend.protocol builds the bodies as plain dicts (the hot path never validates them);
these models only describe them, so that a client generator, or a conformance test against the
served schema (tests/test_openapi_conformance.py), can hold the server to what it says.
Objects that carry extensions (`usage`, a node's health) admit fields beyond those named.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.frontend.protocol import FinishReason


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        description="prompt tokens whose KV the serving engine's prefix cache held"
    )


class Usage(BaseModel):
    # Extensions: completion_tokens_details, spec_verify_steps, spec_accept_length, timeline.
    model_config = ConfigDict(extra="allow")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Absent where the serving engine runs no prefix cache.
    prompt_tokens_details: PromptTokensDetails | None = None


class _Choice(BaseModel):
    index: int
    finish_reason: FinishReason | None
    logprobs: dict[str, Any] | None
    token_ids: list[int] = Field(description="extension: the ids of the generated tokens")


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the answer is tool calls
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None


class CompletionChoice(_Choice):
    text: str


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthReport(BaseModel):
    """What the backend reports ("nodes": each node's state), with the status "draining" and
    the requests still "in_flight" while the server drains."""

    model_config = ConfigDict(extra="allow")

    status: str


def generation_responses(body: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 of a generation route: `body` as JSON, or with "stream": true, server-sent
    events whose data are chunks of the same shape (the last one "[DONE]")."""
    events = {"schema": {"type": "string"}}
    return {
        200: {
            "model": body,
            "description": "The generated text, or a stream of chunks (stream: true)",
            "content": {"text/event-stream": events},
        }
    }


HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": HealthReport, "description": "Every node is up"},
    503: {"model": HealthReport, "description": "A node is down, or the server is draining"},
}

METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus exposition text",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    },
}
