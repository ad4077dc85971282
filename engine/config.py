"""How one engine instance runs a model (EngineConfig), frozen. What the model is, is
engine.model_config's; the checks of the speculative options are engine.speculative_options'."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.executor.debug_dump import TensorDumpConfig, refuse_cuda_graphs
from engine.speculative_options import (
    check_draft_tree,
    check_draft_vocab_choice,
    check_speculative_plan,
)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """float32 on CPU and bfloat16 on GPU unless told otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if device == "cpu" else torch.bfloat16
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(names)}")
    return names[dtype]


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs a model. Built once; derived values are properties."""

    device: str = field(default_factory=default_device)
    dtype: torch.dtype = torch.float32
    max_num_seqs: int = 64
    max_model_len: int = 4096
    # The most max_tokens one request may ask for (--max-tokens-cap); None: no cap of its own.
    max_tokens_cap: int | None = None
    kv_cache_tokens: int = 16384
    max_prefill_tokens: int = 8192
    # Prompts longer than this are prefilled over several steps (engine/scheduling/scheduler.py);
    # None: every prompt in one step.
    chunked_prefill_size: int | None = None
    attention_backend: str = "torch"
    # Decode batches up to this size replay CUDA graphs (engine/executor/cuda_graph.py); 0: none.
    cuda_graph_max_bs: int = 0
    # Prefill steps of up to this many tokens replay CUDA graphs too (with cuda_graph_max_bs);
    # 0: prefill runs eagerly.
    cuda_graph_max_prefill_tokens: int = 0
    # Plain decode steps launch the next step before reading their tokens
    # (engine/executor/overlap.py).
    overlap_schedule: bool = False
    # A step that admits prompts while requests run decodes the running requests in the same
    # forward (engine/scheduling/scheduler.py); off: such a step stops them. Speculating engines
    # never mix.
    mixed_prefill: bool = True
    # Reuse the KV of the longest cached prefix of each prompt (engine/scheduling/prefix_cache.py);
    # off by itself where the engine speculates.
    enable_prefix_cache: bool = True
    seed: int = 0
    # Draft chains per request when speculating: the draft tree that branches at the first
    # draft only (spec/runtime/tree.py).
    num_draft_chains: int = 1
    # A draft token tree instead (spec/runtime/tree.py): each expanded node's `speculative_topk`
    # likeliest children, `num_draft_tokens` nodes verified (0: topk x depths, at most
    # MAX_DRAFT_TREE_TOKENS); 1: chains.
    speculative_topk: int = 1
    num_draft_tokens: int = 0
    # A draft that ships a vocabulary proposes from it ("draft") or from the target's whole
    # vocabulary ("full"); a draft without one always uses the whole vocabulary.
    draft_vocab: str = "draft"
    # How each decode step's round plan is chosen (spec/runtime/round_plan.py): "adaptive"
    # speculates where a round is measured to pay, "always" wherever a request has drafts to verify;
    # at `speculative_disable_batch_size` requests or more (None: no such size) every step is plain.
    speculative_plan: str = "adaptive"
    speculative_disable_batch_size: int | None = None
    # float32 linear layers on CPU run through oneDNN with prepacked weights (see cpu_linear.py).
    cpu_packed_linear: bool = True
    # Set by --debug-tensor-dump-dir: where this engine's forward passes are dumped.
    tensor_dump: TensorDumpConfig | None = None
    # Ranks the model is split over, one process each (engine/tensor_parallel/).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        names = ("max_num_seqs", "max_model_len", "kv_cache_tokens", "max_prefill_tokens")
        for name in names + ("tensor_parallel_size",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(
                f"chunked_prefill_size must be positive, got {self.chunked_prefill_size}"
            )
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be positive, got {self.max_tokens_cap}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_max_prefill_tokens < 0:
            raise ValueError(
                "cuda_graph_max_prefill_tokens must be >= 0, "
                f"got {self.cuda_graph_max_prefill_tokens}"
            )
        check_speculative_plan(self.speculative_plan, self.speculative_disable_batch_size)
        graphs = self.cuda_graph_max_bs > 0 or self.cuda_graph_max_prefill_tokens > 0
        refuse_cuda_graphs(self.tensor_dump is not None, graphs)
        if self.num_draft_chains < 1:
            raise ValueError(f"num_draft_chains must be >= 1, got {self.num_draft_chains}")
        check_draft_tree(
            self.speculative_topk, self.num_draft_tokens or None, self.num_draft_chains
        )
        check_draft_vocab_choice(self.draft_vocab)

    @property
    def draft_request_rows(self) -> int:
        """Rows of each draft depth's request table: max_num_seqs for requests, the rest for
        the forks of draft trees (spec/runtime/tree_extender.py), as many as a level expands."""
        return self.max_num_seqs * max(self.num_draft_chains, self.speculative_topk)
