"""What the router puts into the control plane's messages (the sampling parameters, the prompt's
embeddings) and reads out of the nodes' token frames (logprobs, speculation figures)."""

from __future__ import annotations

from typing import Any

from engine.executor.prompt_embeds import PromptEmbeds
from engine.sampling.sampler import TokenLogprob
from engine.sampling.sampling_params import SamplingParams
from metadata.messages import EmbeddingsSpec, SamplingSpec

SPECULATION_USAGE_KEYS = ("completion_tokens_details", "spec_verify_steps", "spec_accept_length")


def speculation_usage(stats: dict[str, Any]) -> dict[str, Any]:
    """The decode node's speculation figures, under the names `usage` carries them."""
    return {key: stats[key] for key in SPECULATION_USAGE_KEYS if key in stats}


def embeddings_spec(prompt_embeds: PromptEmbeds | None) -> EmbeddingsSpec | None:
    if prompt_embeds is None:
        return None
    return EmbeddingsSpec(
        list(prompt_embeds.positions), prompt_embeds.width, prompt_embeds.to_bytes()
    )


def sampling_spec(params: SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=params.max_tokens,
        temperature=float(params.temperature),
        top_k=params.top_k,
        top_p=float(params.top_p),
        seed=params.seed,
        stop=list(params.stop_strings),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        repetition_penalty=float(params.repetition_penalty),
        logit_bias=[[token, bias] for token, bias in params.logit_bias_items],
        min_tokens=params.min_tokens,
        grammar=params.grammar,
    )


def token_logprob(entry: list) -> TokenLogprob:
    """One entry of `StreamLogprobs.logprobs`: [token, logprob, [[token, logprob], ...] of the
    top]."""
    token, logprob, top = entry
    return TokenLogprob(int(token), float(logprob), [(int(t), float(v)) for t, v in top])
