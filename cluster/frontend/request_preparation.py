"""From a validated request body to what the backend takes: the prompt's token ids, the
sampling parameters and any prompt embeddings, checked against the backend's limits.

`check_request` holds the checks that cost nothing and runs on the event loop;
`prepare_chat` and `prepare_completion` hold everything that grows with the prompt (checking
its text, tokenizing it, validating the token ids) and run on a worker thread, so a backend's
`apply_chat_template` and `validate` must be safe to call off the event loop (LocalBackend's
and the router's only read fixed configuration and thread-safe counters). Every refusal is
an OpenAIError naming the field; a ValueError, TypeError or OverflowError that escapes a step
is refused too, naming the step, rather than answered as a 500.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from cluster.frontend.api_errors import OpenAIError
from cluster.frontend.backend import GenerationBackend
from cluster.frontend.request_schema import ChatCompletionRequest, CompletionRequest
from cluster.frontend.structured_output import ToolUse, response_format_grammar, with_tools_prompt
from engine import RequestRejectedError, SamplingParams
from engine.executor.prompt_embeds import PromptEmbeds
from engine.sampling.sampling_params import MAX_LOGIT_BIAS

log = logging.getLogger("cluster.frontend.openai_api")

# A body of a million made-up fields must not make a log line of them.
MAX_NAMED_UNKNOWN_FIELDS = 10


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready for the backend: tokenized, with its sampling parameters, validated."""

    prompt: list[int]
    params: SamplingParams
    prompt_embeds: PromptEmbeds | None = None
    # A chat request's tools: the answer is read back as tool calls
    # (cluster.frontend.structured_output).
    tools: ToolUse | None = None


def require_served_model(name: str, backend: GenerationBackend) -> None:
    if name != backend.model_name:
        raise OpenAIError(
            404,
            f"the model {name!r} does not exist; this server serves {backend.model_name!r}",
            param="model",
            code="model_not_found",
        )


def check_request(
    body: ChatCompletionRequest | CompletionRequest, backend: GenerationBackend, path: str
) -> None:
    if body.model is not None:
        require_served_model(body.model, backend)
    unsupported = body.unsupported_field()
    if unsupported is not None:
        name, reason = unsupported
        raise OpenAIError(400, reason, param=name)
    unknown = body.unknown_fields()
    if unknown:
        # As vLLM does: a field from a newer API or another server must not break a client.
        named = ", ".join(repr(name) for name in unknown[:MAX_NAMED_UNKNOWN_FIELDS])
        if len(unknown) > MAX_NAMED_UNKNOWN_FIELDS:
            named += f" and {len(unknown) - MAX_NAMED_UNKNOWN_FIELDS} more"
        log.warning("%s: ignoring unknown fields %s", path, named)


def prepare_chat(body: ChatCompletionRequest, backend: GenerationBackend) -> list[PreparedRequest]:
    """The conversation's prompt, as a list of one (what `prepare_completion` gives)."""
    _require_valid_unicode(body)
    with _refused_as_invalid("reading tools", "tools"), _rejected_as_400():
        tools = ToolUse(body.tools or [], body.tool_choice, body.parallel_tool_calls)
    prompt = _chat_prompt(body, backend, tools)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    grammar = _grammar(body, tools)
    params = _sampling_params(
        body, body.requested_max_tokens, logprobs, len(prompt), backend, grammar
    )
    prepared = PreparedRequest(prompt, params, tools=tools if tools.active else None)
    return [_validated(backend, prepared)]


@contextlib.contextmanager
def _rejected_as_400() -> Iterator[None]:
    try:
        yield
    except RequestRejectedError as err:
        raise OpenAIError(400, str(err), param=err.param) from err


def _grammar(body: ChatCompletionRequest | CompletionRequest, tools: ToolUse | None) -> str | None:
    """The grammar of the answer: a forced tool call's, or response_format's."""
    with _rejected_as_400():
        tool_grammar = tools.grammar() if tools is not None else None
        format_grammar = response_format_grammar(body.response_format)
    if tool_grammar is not None and format_grammar is not None:
        message = "response_format cannot constrain an answer that tool_choice forces to a call"
        raise OpenAIError(400, message, param="response_format")
    return tool_grammar or format_grammar


def prepare_completion(
    body: CompletionRequest, backend: GenerationBackend
) -> list[PreparedRequest]:
    """One PreparedRequest per prompt, in the order given (a batch of prompts is a list of
    strings or of token-id lists), all with the same sampling parameters."""
    _require_valid_unicode(body)
    prompts = _prompt_token_ids(body.prompt, backend.tokenizer)
    prompt_embeds = _prompt_embeds(body)
    if prompt_embeds is not None and len(prompts) > 1:
        raise OpenAIError(
            400, "prompt_embeds needs a single prompt, not a batch", param="prompt_embeds"
        )
    longest = max(len(prompt) for prompt in prompts)
    max_tokens = body.max_tokens
    cap = getattr(backend, "max_tokens_cap", None)
    if "max_tokens" not in body.model_fields_set and cap is not None:
        # The API's default of 16 must not be refused for a cap the client never asked past.
        max_tokens = min(max_tokens, cap)
    grammar = _grammar(body, None)
    params = _sampling_params(body, max_tokens, body.logprobs, longest, backend, grammar)
    return [_validated(backend, PreparedRequest(p, params, prompt_embeds)) for p in prompts]


@contextlib.contextmanager
def _refused_as_invalid(step: str, param: str | None = None) -> Iterator[None]:
    """The exceptions a value the tokenizer, the sampling parameters or a message to a node
    cannot take raises are the input's fault: a 400, not a 500 (after which the HTTP server
    would also drop the keep-alive connection)."""
    try:
        yield
    except (OpenAIError, RequestRejectedError):
        raise
    except (ValueError, TypeError, OverflowError) as err:
        message = f"invalid request: {step} failed: {type(err).__name__}: {err}"
        raise OpenAIError(400, message, param=param) from err


def _validated(backend: GenerationBackend, prepared: PreparedRequest) -> PreparedRequest:
    # Passed only when given, so that a backend without the extension serves the rest.
    extension = {} if prepared.prompt_embeds is None else {"prompt_embeds": prepared.prompt_embeds}
    with _refused_as_invalid("validating the request"):
        backend.validate(prepared.prompt, prepared.params, **extension)
    return prepared


def _require_valid_unicode(body: ChatCompletionRequest | CompletionRequest) -> None:
    # JSON may carry a lone UTF-16 surrogate ("\ud800"): a Python str, but not text that the
    # tokenizer, or the UTF-8 of a message to a node, can hold.
    for param, text in body.texts():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise OpenAIError(
                400,
                f"{param} is not valid Unicode: a lone UTF-16 surrogate "
                f"{text[err.start]!r} at character {err.start}",
                param=param,
            ) from err


def _chat_prompt(
    body: ChatCompletionRequest, backend: GenerationBackend, tools: ToolUse
) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    messages = with_tools_prompt(messages, tools)
    with _refused_as_invalid("applying the chat template", "messages"):
        try:
            return backend.apply_chat_template(messages)
        except (LookupError, TemplateError) as err:
            message = f"could not apply the chat template: {err}"
            raise OpenAIError(400, message, param="messages") from err


def _prompt_token_ids(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """The token ids of each prompt: one string or token-id list, or a list of either."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        prompt = [prompt]
    prompts = []
    for index, item in enumerate(prompt):
        if isinstance(item, str):
            param = "prompt" if len(prompt) == 1 else f"prompt[{index}]"
            with _refused_as_invalid("tokenizing the prompt", param):
                # The same encoding as engine.LLM.generate, so both give the same tokens.
                prompts.append(tokenizer.encode(item))
        else:
            prompts.append(list(item))
    return prompts


def _prompt_embeds(body: CompletionRequest) -> PromptEmbeds | None:
    """The extension's vectors; their width and positions are the backend's to check."""
    if body.prompt_embeds is None:
        return None
    with _refused_as_invalid("reading prompt_embeds", "prompt_embeds"):
        try:
            return PromptEmbeds.of((item.position, item.embedding) for item in body.prompt_embeds)
        except RequestRejectedError as err:
            raise OpenAIError(400, str(err), param="prompt_embeds") from err


def _sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_len: int,
    backend: GenerationBackend,
    grammar: str | None = None,
) -> SamplingParams:
    if max_tokens is None:
        max_tokens = _default_max_tokens(prompt_len, backend)
    optional = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k_or_disabled,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "min_tokens": body.min_tokens,
    }
    if body.min_tokens is not None and body.min_tokens > max_tokens:
        raise OpenAIError(
            400,
            f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})",
            param="min_tokens",
        )
    with _refused_as_invalid("building the sampling parameters"):
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                stop=body.stop or (),
                stop_token_ids=body.stop_token_ids or (),
                seed=body.seed,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                logit_bias=_logit_bias(body.logit_bias),
                n=body.n,
                grammar=grammar,
                **{name: value for name, value in optional.items() if value is not None},
            )
        except RequestRejectedError as err:
            raise OpenAIError(400, str(err), param=err.param) from err


def _default_max_tokens(prompt_len: int, backend: GenerationBackend) -> int:
    """Unset max_tokens (chat) means "until the context is full", as in the OpenAI API, and no
    more than the server's cap, as vLLM clamps it to what fits: a request that gives no
    max_tokens is never refused for the cap."""
    room = backend.max_model_len - prompt_len
    if room < 1:
        raise OpenAIError(
            400,
            f"the prompt ({prompt_len} tokens) fills the context of {backend.max_model_len} tokens",
            param="messages",
        )
    cap = getattr(backend, "max_tokens_cap", None)
    return room if cap is None else min(room, cap)


def _logit_bias(given: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias: token ids as JSON object keys (strings), biases in [-100, 100].
    Token ids beyond the vocabulary are the backend's to refuse (`validate`)."""
    bias: dict[int, float] = {}
    for key, value in (given or {}).items():
        if not key.isascii() or not key.isdigit():
            message = f"logit_bias keys must be token ids (non-negative integers), got {key!r}"
            raise OpenAIError(400, message, param="logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            message = (
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {value} for token {key}"
            )
            raise OpenAIError(400, message, param="logit_bias")
        bias[int(key)] = value
    return bias
