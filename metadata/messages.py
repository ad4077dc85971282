"""Typed control-plane messages of requests and their transfers: what the front ends, decode
nodes and prefill nodes tell each other about a request, from its GenerateRequest to its KV's
landing. The front ends' streams and the cluster's status are in metadata.stream_messages; the
wire format (msgpack, a type and a version, every field checked) in metadata.message_codec."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from metadata.message_codec import (  # noqa: F401 - the wire's names, where messages are used
    PROTOCOL_VERSION,
    MessageError,
    decode,
    encode,
    message,
)
from metadata.stream_messages import (  # noqa: F401 - one place to import messages from
    ApiServerStatus,
    ClusterStatus,
    ForgetFrontend,
    FrontendHello,
    NodeLoad,
    NodeStatus,
    StreamEnd,
    StreamLogprobs,
    StreamOpen,
    StreamStep,
    TokenFrame,
)


@message
class SamplingSpec:
    """The sampling settings that cross the wire (engine.SamplingParams' fields)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    # Logits processors (engine.sampling.logits_processors); the defaults ask for none, so a sender
    # that predates them still decodes.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[list[Any]] = field(default_factory=list)  # [[token id, bias], ...]
    min_tokens: int = 0
    # Structured output: llguidance grammar text (engine.sampling.grammar), compiled by each node.
    grammar: str | None = None


@message
class EmbeddingsSpec:
    """Vectors given for some prompt positions (engine.executor.prompt_embeds.PromptEmbeds): `data`
    is len(positions) x width float32 values, little-endian, row after row."""

    positions: list[int]
    width: int
    data: bytes


@message
class ParallelSample:
    """Another sample of a request's prompt (`n` > 1): a request of its own (room, id, abort,
    token stream) that shares the prompt's prefill and KV. Samples of one prompt differ by
    their seed stream only (engine.SamplingParams.for_sample)."""

    room: int
    request_id: str
    seed: int | None


@message
class GenerateRequest:
    """Front end -> decode node: preallocate for this request, then ask `prefill_node` to run it.
    `samples`: the prompt's other samples, which share its prefill (one prefill, one transfer
    of the prompt's target KV, forked slots on the decode node)."""

    room: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    prefill_node: int
    # The front end (API process) that streams it: its tokens go there (FrontendHello).
    frontend: int
    prompt_embeds: EmbeddingsSpec | None = None
    samples: list[ParallelSample] = field(default_factory=list)


@message
class PrefillRequest:
    """Decode node -> prefill node: slots are reserved; compute and send to `decode_rank`."""

    room: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    decode_node: int
    decode_rank: int
    prompt_embeds: EmbeddingsSpec | None = None
    # The prompt's other samples: one prefill for all; this room's transfer carries the
    # prompt's target KV, each sample's its own first token, chain and draft KV.
    samples: list[ParallelSample] = field(default_factory=list)
    # Leading prompt positions whose KV (the target's and every draft depth's) the decode node
    # holds already, in its prefix cache (decode_node.reuse): the transfer carries the rest.
    reused_tokens: int = 0


@message
class TransferAnnounce:
    """Prefill node -> decode node, when the request's prefill batch is admitted (before its
    forward): receive `num_tokens` of KV next. Every announced transfer is sent, whatever
    happens to the prefill; its PrefillResult says whether what lands is the request's KV."""

    room: int
    prefill_rank: int
    num_tokens: int
    # Draft depths whose KV and chain follow the target's KV (0: this request does not draft).
    num_draft_tokens: int = 0
    # A parallel sample that shares its prompt's KV: the room whose transfer carries the
    # prompt's target KV and each draft depth's (this one then carries no target KV, only each
    # depth's positions from spec.runtime.sample_extend.shared_prompt_len on, and its row). 0: this
    # transfer carries its own prompt's.
    prompt_room: int = 0
    # The PrefillRequest's reused_tokens, said back: the KV sent (the target's and each draft
    # depth's) is that of positions [reused_tokens, num_tokens) only.
    reused_tokens: int = 0


@message
class PrefillResult:
    """Prefill node -> decode node, after the forward and before the announced transfer is
    sent: what the metadata row does not carry, or why the prefill failed (`error`, naming
    the prefill node). A failed prefill still sends its announced transfer, under a row whose
    room tag never matches, because the decode node's receives are posted and cannot be
    cancelled."""

    room: int
    # Top log-probabilities of the first token, when the request asked for them: [[id, lp], ...]
    first_token_top_logprobs: list[list[Any]] = field(default_factory=list)
    # The request's timeline on the prefill node when it traces: [[name, time_ns(, args)], ...]
    trace: list[list[Any]] = field(default_factory=list)
    error: str | None = None
    # Prompt tokens whose KV the prefill node's prefix cache held (usage's cached_tokens);
    # None where it runs no prefix cache.
    cached_tokens: int | None = None


@message
class TransferAbandoned:
    """Prefill node -> decode node: this room will not be sent nor announced (refused, or
    aborted or failed before the step that completes its prompt)."""

    room: int
    reason: str


@message
class AbortRequest:
    """Front end -> decode node, decode node -> prefill node: stop the request, free its
    slots."""

    room: int
