"""The single-device engine shared by prefill and decode nodes, and the offline `LLM`."""

from engine.errors import (
    ModelLoadError,
    PdclusterError,
    RequestRejectedError,
    UnsupportedModelError,
)
from engine.llm import LLM
from engine.request import RequestOutput, Usage
from engine.sampler import TokenLogprob
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "ModelLoadError",
    "PdclusterError",
    "RequestOutput",
    "RequestRejectedError",
    "SamplingParams",
    "TokenLogprob",
    "UnsupportedModelError",
    "Usage",
]
