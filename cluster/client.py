"""Python client for a pdcluster server (or any OpenAI-compatible one), sync and async, on httpx.

    with Client("http://127.0.0.1:8000") as client:
        print(client.generate("The capital of France is", max_tokens=8).text)
        for chunk in client.chat([{"role": "user", "content": "Hi"}], stream=True):
            print(chunk.text, end="")

Non-streaming calls return a `Completion`; streaming calls return an iterator (an async iterator
for `AsyncClient`) of `CompletionChunk`, the last of which carries finish_reason and usage.
With `n` > 1, or several prompts given to `generate`, `Completion.choices` holds every choice
(index prompt_index * n + sample_index) and each chunk names its choice's `index`.
`response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {...}})
and, for chat, `tools`, `tool_choice` and `parallel_tool_calls` take OpenAI's values; tool
calls come back in `Completion.tool_calls` / `Choice.tool_calls`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from cluster.client_protocol import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    Choice,
    Completion,
    CompletionChunk,
    CompletionUsage,
    Prompt,
    StreamParser,
    WireFormat,
    chat_fields,
    completion_fields,
    error_from_response,
    transport_errors,
    wire_logit_bias,
)

__all__ = [
    "APIConnectionError",
    "APIError",
    "APITimeoutError",
    "AsyncClient",
    "Choice",
    "Client",
    "Completion",
    "CompletionChunk",
    "CompletionUsage",
]


class Client:
    """Blocking client. `model=None` lets a pdcluster server pick the model it serves."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 60.0,
        model: str | None = None,
    ) -> None:
        self._wire = WireFormat(base_url, api_key, model)
        self._http = httpx.Client(
            base_url=self._wire.base_url, headers=self._wire.headers, timeout=timeout
        )

    def generate(
        self,
        prompt: Prompt,
        *,
        max_tokens: int | None = 16,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
        n: int | None = None,
        response_format: dict[str, Any] | None = None,
        stream: bool = False,
    ) -> Completion | Iterator[CompletionChunk]:
        """Complete a prompt (text or token ids, or a list of either for several prompts);
        `logprobs=n` also returns the top n. The
        penalties, `logit_bias` ({token id: bias}) and `min_tokens` are the engine's
        (engine.SamplingParams)."""
        fields = completion_fields(
            prompt,
            max_tokens,
            logprobs,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=wire_logit_bias(logit_bias),
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            n=n,
            response_format=response_format,
        )
        return self._post("/v1/completions", self._wire.body(stream, **fields), stream)

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
        n: int | None = None,
        response_format: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        stream: bool = False,
    ) -> Completion | Iterator[CompletionChunk]:
        """Answer a conversation; max_tokens=None runs to the end of the context or a stop."""
        fields = chat_fields(
            messages,
            max_tokens,
            logprobs,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=wire_logit_bias(logit_bias),
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            n=n,
            response_format=response_format,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
        )
        return self._post("/v1/chat/completions", self._wire.body(stream, **fields), stream)

    def models(self) -> list[dict[str, Any]]:
        return self._get("/v1/models")["data"]

    def health(self) -> dict[str, Any]:
        """The server's health report; an unhealthy server (503) still returns its report."""
        with transport_errors():
            response = self._http.get("/health")
        if response.status_code not in (200, 503):
            raise error_from_response(response)
        return response.json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, path: str) -> dict[str, Any]:
        with transport_errors():
            response = self._http.get(path)
        if response.is_error:
            raise error_from_response(response)
        return response.json()

    def _post(
        self, path: str, body: dict[str, Any], stream: bool
    ) -> Completion | Iterator[CompletionChunk]:
        with transport_errors():
            request = self._http.build_request("POST", path, json=body)
            response = self._http.send(request, stream=stream)
            if response.is_error:
                response.read()
                response.close()
                raise error_from_response(response)
        if not stream:
            return WireFormat.completion(response.json())
        return self._chunks(response)

    @staticmethod
    def _chunks(response: httpx.Response) -> Iterator[CompletionChunk]:
        parser = StreamParser()
        try:
            with transport_errors():
                for line in response.iter_lines():
                    yield from parser.feed(line)
                    if parser.done:
                        return
            yield from parser.flush()
        finally:
            response.close()


class AsyncClient:
    """The asyncio twin of Client: the same methods, awaited; a streaming call returns an async
    iterator (`async for chunk in await client.chat(..., stream=True)`)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 60.0,
        model: str | None = None,
    ) -> None:
        self._wire = WireFormat(base_url, api_key, model)
        self._http = httpx.AsyncClient(
            base_url=self._wire.base_url, headers=self._wire.headers, timeout=timeout
        )

    async def generate(
        self,
        prompt: Prompt,
        *,
        max_tokens: int | None = 16,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
        n: int | None = None,
        response_format: dict[str, Any] | None = None,
        stream: bool = False,
    ) -> Completion | AsyncIterator[CompletionChunk]:
        fields = completion_fields(
            prompt,
            max_tokens,
            logprobs,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=wire_logit_bias(logit_bias),
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            n=n,
            response_format=response_format,
        )
        return await self._post("/v1/completions", self._wire.body(stream, **fields), stream)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int | None = None,
        stop_token_ids: list[int] | None = None,
        n: int | None = None,
        response_format: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        stream: bool = False,
    ) -> Completion | AsyncIterator[CompletionChunk]:
        fields = chat_fields(
            messages,
            max_tokens,
            logprobs,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=wire_logit_bias(logit_bias),
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            n=n,
            response_format=response_format,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
        )
        body = self._wire.body(stream, **fields)
        return await self._post("/v1/chat/completions", body, stream)

    async def models(self) -> list[dict[str, Any]]:
        with transport_errors():
            response = await self._http.get("/v1/models")
        if response.is_error:
            raise error_from_response(response)
        return response.json()["data"]

    async def health(self) -> dict[str, Any]:
        with transport_errors():
            response = await self._http.get("/health")
        if response.status_code not in (200, 503):
            raise error_from_response(response)
        return response.json()

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _post(
        self, path: str, body: dict[str, Any], stream: bool
    ) -> Completion | AsyncIterator[CompletionChunk]:
        with transport_errors():
            request = self._http.build_request("POST", path, json=body)
            response = await self._http.send(request, stream=stream)
            if response.is_error:
                await response.aread()
                await response.aclose()
                raise error_from_response(response)
        if not stream:
            return WireFormat.completion(response.json())
        return self._chunks(response)

    @staticmethod
    async def _chunks(response: httpx.Response) -> AsyncIterator[CompletionChunk]:
        parser = StreamParser()
        try:
            with transport_errors():
                async for line in response.aiter_lines():
                    for chunk in parser.feed(line):
                        yield chunk
                    if parser.done:
                        return
            for chunk in parser.flush():
                yield chunk
        finally:
            await response.aclose()
