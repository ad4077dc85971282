"""What a decode node makes of a GenerateRequest: its engine requests (one per parallel sample,
sharing the prompt's embeddings) with their token streams, and, once they are preallocated, the
PrefillRequest that asks their prefill node to run them."""

from __future__ import annotations

from decode_node.prealloc import never_fits
from decode_node.samples import SampleGroup, check_shareable, parallel_samples, sample_messages
from decode_node.token_streams import TokenStreams
from decode_node.tracked import Tracked
from engine.engine_core import EngineCore
from engine.errors import RequestRejectedError
from engine.executor.prompt_embeds import PromptEmbeds
from engine.request import Request
from engine.sampling.sampling_params import SamplingParams
from engine.tracing import set_time
from metadata.buffers import MetadataBuffers
from metadata.messages import GenerateRequest, PrefillRequest


def accepted(
    msg: GenerateRequest,
    engine: EngineCore,
    metadata: MetadataBuffers,
    streams: TokenStreams,
    node_name: str,
) -> list[Tracked]:
    """What this node tracks of `msg`: its request, then its parallel samples (a SampleGroup),
    each with its open token stream; none where it cannot serve them, each stream failed with
    the reason."""
    messages = sample_messages(msg) if msg.samples else [msg]
    max_shared = min(metadata.num_rows, engine.kv_cache.max_requests)
    try:
        requests = admitted_requests(msg, messages, engine, max_shared)
    except (RequestRejectedError, ValueError) as err:
        for m in messages:
            streams.fail(msg.frontend, m.room, f"{node_name}: {err}")
        return []
    members = []
    for req, m in zip(requests, messages):
        set_time(req, "decode_received")
        stream = streams.open(msg.frontend, m.room, req.params.stop_strings)
        members.append(Tracked(req, m, stream))
    if len(members) > 1:
        SampleGroup(members)
    return members


def admitted_requests(
    msg: GenerateRequest, messages: list[GenerateRequest], engine: EngineCore, max_shared: int
) -> list[Request]:
    """The requests of `messages` (`msg`, or each of its parallel samples'); raises
    RequestRejectedError or ValueError when this node cannot serve them (`max_shared`: the
    most samples it holds at once)."""
    embeds = None
    if msg.prompt_embeds is not None:
        # Kept with the request: a retracted request's re-prefill here reads them.
        given = msg.prompt_embeds
        embeds = PromptEmbeds.from_bytes(given.positions, given.width, given.data)
    requests = [
        engine.make_request(
            str(m.room),
            list(m.prompt_token_ids),
            SamplingParams(**m.sampling.__dict__),
            prompt_embeds=embeds,
        )
        for m in messages
    ]
    check_shareable(msg, max_shared)
    if (reason := never_fits(requests, engine)) is not None:
        # Waiting could not help, and would hold up every request queued behind it.
        raise ValueError(reason)
    return requests


def prefill_request(
    msg: GenerateRequest, samples: list[Tracked], node_index: int, rank: int, reused: int = 0
) -> PrefillRequest:
    """The request for the prefill of `msg`'s request and of the parallel `samples` that share
    its prompt, whose transfers come to this node (`node_index`, data-plane `rank`), leaving
    out the KV of the first `reused` positions, which this node holds (decode_node.reuse)."""
    return PrefillRequest(
        msg.room,
        msg.request_id,
        msg.prompt_token_ids,
        msg.sampling,
        node_index,
        rank,
        msg.prompt_embeds,
        parallel_samples(samples),
        reused,
    )
