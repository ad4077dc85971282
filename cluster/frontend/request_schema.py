"""OpenAI request bodies (pydantic), and how their validation errors read.

Requests are validated strictly: a string where a number belongs ("max_tokens": "10") is a 400,
as in the OpenAI API, rather than silently coerced. Integers are bounded by what the engine and
the control-plane messages carry, so that no value fails on its way to a node. OpenAI fields this
server does not implement are accepted only at their neutral value and refused by name otherwise
(`unsupported_field`); fields no one here knows are kept aside (`unknown_fields`) for a warning.
Extensions: `top_k`, `ignore_eos`, `repetition_penalty` (transformers' semantics), `min_tokens` and
`stop_token_ids` in requests, `prompt_embeds` in completion requests (vectors that replace the
embeddings of some prompt tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.frontend.structured_output import ResponseFormat, Tool, ToolChoice
from engine.sampling.sampling_params import MAX_LOGIT_BIAS, MAX_SAMPLES, MAX_TOP_LOGPROBS
from engine.validation import INT64_MAX, INT64_MIN

NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(min_length=1)]
WireInt = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]

# The values of each unimplemented OpenAI field that ask for nothing this server lacks (null
# and absent always do): anything else is refused by name rather than silently ignored.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "best_of": (1,),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "service_tier": ("auto", "default"),
    # Other servers' structured output fields (vLLM's guided_* and structured_outputs,
    # SGLang's regex and ebnf): refused, since ignored as unknown fields they would leave the
    # answer unconstrained with only a warning in the server's log.
    **{name: () for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    **{name: () for name in ("structural_tag", "structured_outputs", "regex", "ebnf")},
}
# Tools are a chat feature: the completions endpoint takes them at their neutral value only.
COMPLETION_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True,),
}


def _neutral_only(name: str, description: str) -> Any:
    """An unimplemented field: validated by `unsupported_field`, documented as null or one of
    its neutral values."""
    neutral = {**NEUTRAL_VALUES, **COMPLETION_NEUTRAL_VALUES}[name]
    return Field(None, description=description, json_schema_extra={"enum": [None, *neutral]})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant's earlier calls, and the id of the call a tool message answers.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as the template reads it; earlier tool calls in the JSON envelope the
        model was asked to answer with (cluster.frontend.structured_output): one call object, or an
        array of them for several."""
        if self.content is None or isinstance(self.content, str):
            texts = [self.content] if self.content else []
        else:
            texts = ["".join(part.text for part in self.content)]
        calls = [_call_envelope(call) for call in self.tool_calls or []]
        if calls:
            # Without whitespace, as the tools' grammar has the model write them.
            envelope = calls[0] if len(calls) == 1 else calls
            texts.append(json.dumps(envelope, separators=(",", ":")))
        return "\n".join(texts)


def _call_envelope(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, ValueError):
        arguments = function.get("arguments")
    return {"name": function.get("name"), "arguments": arguments}


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """What both endpoints share. `model` may be left out: the served model is used."""

    # Kept (not dropped) so that the server can name the fields it ignores in a warning.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = Field(
        None, description="-1 or 0 disables it; at most the model's vocabulary size"
    )
    seed: WireInt | None = Field(None, description="a signed 64-bit integer")
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] = Field(
        1, description="choices per prompt, each sampled with its own seed stream"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # Accepted and unused: they ask nothing of the generation.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = Field(
        None, description="over prompt and generated tokens, as in transformers; 1 disables it"
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        Field(None, description="token id (a string) -> bias in [-100, 100]")
    )
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = Field(
        None, description="end-of-sequence and stop_token_ids are masked until this many"
    )
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    # Accepted so that clients which always send them at their neutral value keep working;
    # any other value is refused rather than silently ignored. The schema lists the values
    # accepted, so that a client (or a generated one) knows before it asks.
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema (the answer follows the schema)"
    )
    functions: Any = _neutral_only("functions", "not supported: only an empty list")
    function_call: Any = _neutral_only("function_call", 'not supported: only "none"')
    best_of: Any = _neutral_only("best_of", "not supported: only 1")
    modalities: Any = _neutral_only("modalities", 'not supported: only ["text"]')
    audio: Any = _neutral_only("audio", "not supported")
    prediction: Any = _neutral_only("prediction", "not supported")
    web_search_options: Any = _neutral_only("web_search_options", "not supported")
    service_tier: Any = _neutral_only("service_tier", 'only "auto" or "default"')
    guided_json: Any = _neutral_only("guided_json", "not supported: use response_format")
    guided_regex: Any = _neutral_only("guided_regex", "not supported")
    guided_choice: Any = _neutral_only("guided_choice", "not supported")
    guided_grammar: Any = _neutral_only("guided_grammar", "not supported")
    structural_tag: Any = _neutral_only("structural_tag", "not supported")
    structured_outputs: Any = _neutral_only("structured_outputs", "not supported")
    regex: Any = _neutral_only("regex", "not supported")
    ebnf: Any = _neutral_only("ebnf", "not supported")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def top_k_or_disabled(self) -> int | None:
        # -1 is how vLLM spells "no top-k"; the engine spells it 0.
        return 0 if self.top_k == -1 else self.top_k

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, reason) for the first field set to something this server does not do."""
        for name, neutral in self._neutral_values().items():
            value = getattr(self, name)
            if value is not None and not _is_one_of(value, neutral):
                reason = f"{name} is not supported by this server"
                if neutral:
                    reason += f" (only {' or '.join(json.dumps(v) for v in neutral)})"
                return name, reason
        return None

    def _neutral_values(self) -> dict[str, tuple[Any, ...]]:
        return NEUTRAL_VALUES

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def texts(self) -> Iterator[tuple[str, str]]:
        """(field, text) for every string that reaches the tokenizer or a node."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        for index, stop in enumerate(stops):
            yield ("stop" if isinstance(self.stop, str) else f"stop[{index}]"), stop


def _is_one_of(value: Any, neutral: tuple[Any, ...]) -> bool:
    # Compared with the type too: `true` is not the `1` of best_of, nor 1 the `true` of
    # parallel_tool_calls.
    return any(type(value) is type(v) and value == v for v in neutral)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    prompt_embeds: Any = Field(
        None, description="only accepted by /v1/completions", json_schema_extra={"enum": [None]}
    )
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: ToolChoice | None = Field(
        None, description='"none", "auto" (the default with tools), "required", or a function'
    )
    parallel_tool_calls: bool | None = Field(
        None, description="whether one answer may hold several calls (the default: true)"
    )

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.prompt_embeds is not None:
            return "prompt_embeds", "prompt_embeds is only accepted by /v1/completions"
        return super().unsupported_field()

    def texts(self) -> Iterator[tuple[str, str]]:
        for index, message in enumerate(self.messages):
            if isinstance(message.content, str):
                yield f"messages[{index}].content", message.content
            elif message.content is not None:
                for part_index, part in enumerate(message.content):
                    yield f"messages[{index}].content[{part_index}].text", part.text
        yield from super().texts()


class PromptEmbedding(_Strict):
    """A vector given in place of the embedding of the prompt token at `position` (a position
    in the tokenized prompt; the token there stays as a placeholder)."""

    position: Annotated[int, Field(ge=0, le=INT64_MAX)]
    embedding: list[float]


class CompletionRequest(_SamplingFields):
    prompt: (
        NonEmptyText
        | TokenIds
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: Count = 16
    logprobs: TopLogprobs | None = None
    echo: bool = Field(False, json_schema_extra={"enum": [False]})
    tools: Any = _neutral_only("tools", "chat only: only an empty list")
    tool_choice: Any = _neutral_only("tool_choice", 'chat only: only "none"')
    parallel_tool_calls: Any = _neutral_only("parallel_tool_calls", "chat only: only true")
    suffix: str | None = Field(None, json_schema_extra={"enum": ["", None]})
    prompt_embeds: list[PromptEmbedding] | None = None

    def _neutral_values(self) -> dict[str, tuple[Any, ...]]:
        return NEUTRAL_VALUES | COMPLETION_NEUTRAL_VALUES

    def texts(self) -> Iterator[tuple[str, str]]:
        if isinstance(self.prompt, str):
            yield "prompt", self.prompt
        for index, item in enumerate(self.prompt):
            if isinstance(item, str):
                yield f"prompt[{index}]", item
        yield from super().texts()


# ---- validation errors -------------------------------------------------------------------

# pydantic names the branches of a union in error locations ("str", "list[str]",
# "constrained-str"); they are types, not fields, so they are left out of `param`.
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def describe_validation_error(errors: Any) -> tuple[str, str | None]:
    """pydantic errors -> (message, param): every problem with the first field that failed."""
    errors = list(errors)
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    if not _field_path(first.get("loc", ())):
        return f"the request body must be a JSON object: {first.get('msg')}", None
    field = next(p for p in first["loc"] if p != "body")
    related = [e for e in errors if field in e.get("loc", ())[:2]]
    # In a union, the branch whose type matched says what is wrong with the value; the others
    # only say that it has another type.
    about_value = [e for e in related if not str(e.get("type", "")).endswith("_type")]
    chosen = about_value or related
    reasons = [f"{_field_path(e['loc'])}: {e['msg']}" for e in chosen]
    return f"invalid request: {'; '.join(dict.fromkeys(reasons))}", _field_path(chosen[0]["loc"])


def _field_path(loc: Any) -> str:
    named = [
        f"[{p}]" if isinstance(p, int) else f".{p}"
        for p in loc
        if isinstance(p, int)
        or (p != "body" and not set("[-") & set(p) and p.lower() not in _TYPE_NAMES and p.islower())
    ]
    return "".join(named).lstrip(".")
