"""The single-device engine shared by prefill and decode nodes, and the offline `LLM`.

Folders by job: engine/executor (the model runner, batches, CUDA graphs, overlap), engine/scheduling
(the scheduler, KV pools and slots, the prefix cache), engine/sampling (sampling parameters,
the sampler, grammars, stopping), engine/loading (finding, converting and loading models),
engine/models, engine/attention, engine/kernels and engine/tensor_parallel; here, the engine's
step (engine_core), its configuration, requests, the speculation seam and `LLM`."""

from engine.errors import (
    ModelLoadError,
    PdclusterError,
    RequestRejectedError,
    UnsupportedModelError,
)
from engine.llm import LLM
from engine.request import RequestOutput, Usage
from engine.sampling.sampler import TokenLogprob
from engine.sampling.sampling_params import SamplingParams

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
