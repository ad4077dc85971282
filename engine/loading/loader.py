"""Turn user-facing engine options into a loaded model: one path for `LLM` and the serving nodes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention import resolve_attention_backend
from engine.config import EngineConfig, default_device, resolve_dtype
from engine.env import speculative_plan_default
from engine.errors import TensorParallelError
from engine.executor.debug_dump import OFFLINE_NODE, tensor_dump_config
from engine.executor.model_runner import ModelRunner
from engine.loading.weights import iter_safetensors, load_hf_config, load_tokenizer, resolve_model
from engine.model_config import ModelConfig
from engine.scheduling.kv_pool import KVPool
from engine.speculation import Speculation, chosen_speculation
from engine.speculative_options import (
    check_draft_tree,
    check_draft_vocab_choice,
    check_speculative_plan,
)
from engine.tensor_parallel.layers import ModelShard
from engine.tensor_parallel.layout import check_tensor_parallel, check_tensor_parallel_options
from engine.tensor_parallel.leader import start_tensor_parallel

DEFAULT_CPU_KV_BYTES = 2 * 1024**3
DEFAULT_GPU_KV_FRACTION = 0.8
# docs/BENCHMARKS.md, "Chunked prefill": the TTFT of a short request behind a long prompt
# against the long prompt's own. A GPU prefills a chunk in a few milliseconds of which the
# eager forward's launches are a fixed part, so small chunks cost it more than a CPU.
DEFAULT_CHUNKED_PREFILL_SIZE = {"cpu": 2048, "cuda": 4096}
# docs/BENCHMARKS.md, "The whole vocabulary on a GPU": a CPU pays for every row of the LM head a
# depth reads, so it keeps a draft's smaller vocabulary; a GPU reads the whole head in about the
# same time and accepts more with it.
DRAFT_VOCAB_DEFAULT = {"cpu": "draft", "cuda": "full"}


@dataclass(frozen=True)
class EngineArgs:
    """What a user chooses (CLI flags, `LLM(...)` keywords); plain values, so it crosses Ray."""

    model: str | None = None
    dtype: str = "auto"
    device: str | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    # The most max_tokens one request may ask for; None: only the context bounds it.
    max_tokens_cap: int | None = None
    kv_cache_tokens: int | None = None
    max_prefill_tokens: int = 8192
    # Prompts longer than this many tokens are prefilled in chunks of it, interleaved with
    # other work; 0 turns chunking off; None: DEFAULT_CHUNKED_PREFILL_SIZE for the device.
    chunked_prefill_size: int | None = None
    # The fraction of the GPU's total memory this engine may take (weights, KV and activations),
    # for engines that share a GPU; None: the KV pool sizes itself from the memory free at
    # start-up. Unused on CPU and when kv_cache_tokens is given.
    gpu_memory_utilization: float | None = None
    # "auto": triton on a GPU, torch elsewhere (engine.attention).
    attention_backend: str = "auto"
    # Decode steps on a GPU replay CUDA graphs (engine/executor/cuda_graph.py) for batches up to
    # cuda_graph_max_bs (None: max_num_seqs) unless disabled, or unless tensors are dumped.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # Prefill steps of up to this many tokens replay CUDA graphs too, where graphs are on (None:
    # DEFAULT_CUDA_GRAPH_MAX_PREFILL_TOKENS; 0: prefill runs eagerly).
    cuda_graph_max_prefill_tokens: int | None = None
    # The host prepares each plain decode step while the device runs the one before
    # (engine/executor/overlap.py); None: on a GPU, off on a CPU (where host and device are one).
    overlap_schedule: bool | None = None
    # A step that admits prompts while requests run decodes them in the same forward
    # (engine/scheduling/scheduler.py); False: admission steps stop the running requests.
    mixed_prefill: bool = True
    # Reuse cached prompt prefixes' KV (engine/scheduling/prefix_cache.py); off where the engine
    # speculates.
    enable_prefix_cache: bool = True
    seed: int = 0
    # Speculative decoding (see spec/ and docs/draft-format.md); off when algorithm is None.
    speculative_algorithm: str | None = None
    draft_model: str | None = None
    num_draft_steps: int | None = None
    # Chains drafted per greedy request, started with depth 0's most likely tokens
    # (spec/runtime/worker.py); None: DEFAULT_DRAFT_CHAINS.
    num_draft_chains: int | None = None
    # A draft token tree (spec/runtime/tree.py): each expanded node's top-k children,
    # num_draft_tokens nodes verified (default: topk x the draft's depths).
    speculative_topk: int | None = None
    num_draft_tokens: int | None = None
    # The tokens each draft depth may propose (spec/draft_vocab.py): "draft", the vocabulary
    # its folder ships (if any); "full", the target's whole vocabulary; None: DRAFT_VOCAB_DEFAULT
    # for the device.
    draft_vocab: str | None = None
    # How each decode step's round plan is chosen (spec/runtime/round_plan.py): "adaptive"
    # speculates where a round is measured to commit more tokens a second than a plain step,
    # "always" at every step with drafts to verify; None: engine.env.speculative_plan_default().
    speculative_plan: str | None = None
    # At this many running requests or more, every decode step is plain; None: no such size.
    speculative_disable_batch_size: int | None = None
    # Debugging (engine/executor/debug_dump.py): every module's output per forward pass, under
    # DIR/<node>/<target|draft-N>/rank<r>/ (r: the tensor parallel rank). Give an absolute path
    # to a cluster: each node resolves a relative one in its own working directory. Layers: the
    # target decoder layers kept.
    debug_tensor_dump_dir: str | None = None
    debug_tensor_dump_layers: tuple[int, ...] | None = None
    # Ranks the model is split over, one process each (engine/tensor_parallel/, CPU only).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise TensorParallelError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.speculative_algorithm is None and (
            self.draft_model is not None or self.num_draft_steps is not None
        ):
            raise ValueError("draft_model and num_draft_steps need a speculative_algorithm")
        if self.num_draft_chains is not None:
            if self.num_draft_chains < 1:
                raise ValueError(f"num_draft_chains must be >= 1, got {self.num_draft_chains}")
            if self.speculative_algorithm is None:
                raise ValueError("num_draft_chains needs a speculative_algorithm")
        if self.speculative_topk is not None or self.num_draft_tokens is not None:
            if self.speculative_algorithm is None:
                raise ValueError(
                    "speculative_topk and num_draft_tokens need a speculative_algorithm"
                )
            topk = 1 if self.speculative_topk is None else self.speculative_topk
            check_draft_tree(topk, self.num_draft_tokens, self.num_draft_chains)
        if self.draft_vocab is not None:
            check_draft_vocab_choice(self.draft_vocab)
            if self.speculative_algorithm is None:
                raise ValueError("draft_vocab needs a speculative_algorithm")
        plan, disable = self.speculative_plan, self.speculative_disable_batch_size
        if plan is not None or disable is not None:
            if self.speculative_algorithm is None:
                raise ValueError(
                    "speculative_plan and speculative_disable_batch_size need a "
                    "speculative_algorithm"
                )
            check_speculative_plan(plan or "adaptive", disable)
        if self.debug_tensor_dump_layers is not None and self.debug_tensor_dump_dir is None:
            raise ValueError("debug_tensor_dump_layers needs debug_tensor_dump_dir")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 0:
            raise ValueError(
                f"chunked_prefill_size must be >= 0 (0: no chunks), got {self.chunked_prefill_size}"
            )
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        prefill_tokens = self.cuda_graph_max_prefill_tokens
        if prefill_tokens is not None and prefill_tokens < 0:
            raise ValueError(
                f"cuda_graph_max_prefill_tokens must be >= 0 (0: none), got {prefill_tokens}"
            )
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")


@dataclass(frozen=True)
class ModelSpec:
    """The model as resolved on disk: enough to tokenize, validate and describe, no weights."""

    path: Path
    model_config: ModelConfig
    engine_config: EngineConfig
    tokenizer: Any


def resolve(
    args: EngineArgs, node_name: str = OFFLINE_NODE, speculation: Speculation | None = None
) -> ModelSpec:
    """`node_name` ("prefill-0", "decode-1", ...) names this engine's tensor dump folder.
    `speculation`: the speculative algorithm's (engine.speculation), for args that speculate;
    by default the one registered under args.speculative_algorithm."""
    device = args.device or default_device()
    check_tensor_parallel_options(args.tensor_parallel_size, device)
    path = resolve_model(args.model)
    hf_config = load_hf_config(path)
    tokenizer = load_tokenizer(path)
    model_config = ModelConfig.from_hf(hf_config, _eos_token_ids(path, hf_config))
    speculation = chosen_speculation(args.speculative_algorithm, speculation)
    if speculation is not None:
        # The draft may read auxiliary target layers: derived here, once, so the runner, the
        # metadata buffers and the pairing spec all see one spec_hidden_size.
        model_config = speculation.target_config(args, model_config)
    check_tensor_parallel(model_config, args.tensor_parallel_size)
    dtype = resolve_dtype(None if args.dtype == "auto" else args.dtype, device)
    max_model_len = args.max_model_len or model_config.max_position_embeddings
    kv_tokens = args.kv_cache_tokens or _default_kv_tokens(
        model_config, dtype, device, args.gpu_memory_utilization
    )
    backend = resolve_attention_backend(args.attention_backend, device)
    engine_config = EngineConfig(
        device=device,
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        max_tokens_cap=args.max_tokens_cap,
        # More slots than every sequence at full length could use are never needed.
        kv_cache_tokens=min(kv_tokens, args.max_num_seqs * max_model_len),
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=_chunked_prefill_size(args, device),
        attention_backend=backend,
        cuda_graph_max_bs=_cuda_graph_max_bs(args, device, backend),
        cuda_graph_max_prefill_tokens=_cuda_graph_max_prefill_tokens(args, device, backend),
        overlap_schedule=_overlap_schedule(args, device),
        mixed_prefill=args.mixed_prefill,
        enable_prefix_cache=args.enable_prefix_cache,
        seed=args.seed,
        num_draft_chains=_draft_chains(args),
        speculative_topk=args.speculative_topk or 1,
        num_draft_tokens=args.num_draft_tokens or 0,
        draft_vocab=args.draft_vocab or DRAFT_VOCAB_DEFAULT.get(torch.device(device).type, "draft"),
        speculative_plan=args.speculative_plan or speculative_plan_default(),
        speculative_disable_batch_size=args.speculative_disable_batch_size,
        tensor_dump=tensor_dump_config(
            args.debug_tensor_dump_dir,
            args.debug_tensor_dump_layers,
            node_name,
            model_config.num_layers,
        ),
        tensor_parallel_size=args.tensor_parallel_size,
    )
    return ModelSpec(path, model_config, engine_config, tokenizer)


def _chunked_prefill_size(args: EngineArgs, device: str) -> int | None:
    size = args.chunked_prefill_size
    if size is None:
        size = DEFAULT_CHUNKED_PREFILL_SIZE.get(torch.device(device).type, 2048)
    return size or None


# Alternative chains raise the held-out accept length (2.29 to 2.53 with four) but cost a
# wider verify forward and, per chain, a fork in every draft depth. On a CPU the arithmetic
# outweighs the gain; on a GPU with CUDA graphs the per-chain host work does: one chain was
# the faster at batch 1, 16 and 48 (docs/BENCHMARKS.md, "Speculative decoding (CUDA)").
DEFAULT_DRAFT_CHAINS = 1


def _draft_chains(args: EngineArgs) -> int:
    if args.speculative_algorithm is None or args.num_draft_chains is None:
        return DEFAULT_DRAFT_CHAINS
    return args.num_draft_chains


def _graphs_on(args: EngineArgs, device: str, backend: str) -> bool:
    """Graphs need a GPU and the Triton backend; a tensor dump needs eager mode, since a
    replayed graph runs no forward hooks, so dumping turns them off
    (debug_dump.refuse_cuda_graphs guards the engine)."""
    return not (
        args.disable_cuda_graph
        or torch.device(device).type != "cuda"
        or backend != "triton"
        or args.debug_tensor_dump_dir is not None
    )


def _cuda_graph_max_bs(args: EngineArgs, device: str, backend: str) -> int:
    """The largest decode batch captured in a CUDA graph; 0 for none."""
    if not _graphs_on(args, device, backend):
        return 0
    return min(args.cuda_graph_max_bs or args.max_num_seqs, args.max_num_seqs)


# Prompt tokens a prefill graph holds at most: a short prompt's prefill replays one graph where
# its eager forward costs a host dispatch per kernel (tens of milliseconds on a GPU). The graphs
# keep logits for every token column (a padded token is a request of its own), so the largest
# bucket bounds that buffer: 512 x the vocabulary in float32.
DEFAULT_CUDA_GRAPH_MAX_PREFILL_TOKENS = 512


def _cuda_graph_max_prefill_tokens(args: EngineArgs, device: str, backend: str) -> int:
    if not _graphs_on(args, device, backend):
        return 0
    tokens = args.cuda_graph_max_prefill_tokens
    tokens = DEFAULT_CUDA_GRAPH_MAX_PREFILL_TOKENS if tokens is None else tokens
    # No prefill step runs more tokens than max_prefill_tokens.
    return min(tokens, args.max_prefill_tokens)


def _overlap_schedule(args: EngineArgs, device: str) -> bool:
    if args.overlap_schedule is not None:
        return args.overlap_schedule
    # A tensor dump records each forward as it runs: steps stay in order, one at a time.
    return torch.device(device).type == "cuda" and args.debug_tensor_dump_dir is None


def load_runner(spec: ModelSpec) -> ModelRunner:
    """The runner of the spec's engine: on this device, or rank 0 of its tensor parallel ranks
    (which it starts)."""
    if spec.engine_config.tensor_parallel_size > 1:
        return start_tensor_parallel(spec.path, spec.model_config, spec.engine_config)
    return load_rank_runner(spec.path, spec.model_config, spec.engine_config)


def load_rank_runner(
    path: Path,
    model_config: ModelConfig,
    engine_config: EngineConfig,
    shard: ModelShard | None = None,
) -> ModelRunner:
    """A runner of the model at `path`, or with `shard` of one tensor parallel rank's part of
    it (a follower rank loads its own through this)."""
    return ModelRunner(model_config, engine_config, iter_safetensors(path), shard)


def _eos_token_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    from transformers import GenerationConfig

    eos: Any = None
    if (path / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def _default_kv_tokens(
    config: ModelConfig, dtype: torch.dtype, device: str, utilization: float | None = None
) -> int:
    per_token = KVPool.bytes_per_token(
        config.num_layers, config.num_kv_heads, config.head_dim, dtype
    )
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        if utilization is not None:
            # Engines sharing the GPU start together: each keeps to its share of the total,
            # whatever the others had taken when it measured.
            free = min(free, int(total * utilization))
        # Weights are not loaded yet: leave room for them, and a share for activations.
        budget = int(free * DEFAULT_GPU_KV_FRACTION) - _weight_bytes(config, dtype)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    return max(1, budget // per_token)


def _weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    c = config
    attention = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    sparse = len(c.moe.sparse_layers) if c.moe is not None else 0
    mlp = (c.num_layers - sparse) * 3 * c.hidden_size * c.intermediate_size
    if c.moe is not None:
        mlp += sparse * c.moe.weight_count(c.hidden_size)
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return (c.num_layers * attention + mlp + embeddings) * dtype.itemsize


def model_path_arg(model: str | os.PathLike | None) -> str | None:
    return None if model is None else os.fspath(model)
