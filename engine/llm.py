"""`engine.LLM`: the offline, in-process generator (the aggregated baseline).

It builds its engine with `engine.build.build_engine`, the function every node kind builds with.
Speculative decoding is injected, never imported (spec depends on engine): `speculation=` gives
it, else the `Speculation` registered under `speculative_algorithm` is used, which spec registers
when imported and an installed pdcluster declares as an entry point (engine/speculation.py), so
`from engine import LLM` speculates without the engine importing spec."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import torch

from engine.build import build_engine
from engine.errors import PdclusterError
from engine.executor.prompt_embeds import EmbedsArg, PromptEmbeds, per_prompt
from engine.loading.loader import EngineArgs, model_path_arg
from engine.request import RequestOutput
from engine.sampling.sampling_params import SamplingParams
from engine.speculation import Speculation
from engine.tracing import set_time_batch
from engine.validation import chat_prompt_ids

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Generate from a Hugging Face folder, a GGUF file, or (model=None) the embedded default."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | None = None,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_tokens_cap: int | None = None,
        kv_cache_tokens: int | None = None,
        max_prefill_tokens: int = 8192,
        chunked_prefill_size: int | None = None,
        gpu_memory_utilization: float | None = None,
        attention_backend: str = "auto",
        disable_cuda_graph: bool = False,
        cuda_graph_max_bs: int | None = None,
        cuda_graph_max_prefill_tokens: int | None = None,
        overlap_schedule: bool | None = None,
        mixed_prefill: bool = True,
        enable_prefix_cache: bool = True,
        seed: int = 0,
        speculative_algorithm: str | None = None,
        draft_model: str | os.PathLike | None = None,
        num_draft_steps: int | None = None,
        num_draft_chains: int | None = None,
        speculative_topk: int | None = None,
        num_draft_tokens: int | None = None,
        draft_vocab: str | None = None,
        speculative_plan: str | None = None,
        speculative_disable_batch_size: int | None = None,
        debug_tensor_dump_dir: str | os.PathLike | None = None,
        debug_tensor_dump_layers: Sequence[int] | None = None,
        enable_tracing: bool = False,
        speculation: Speculation | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        """With `speculative_algorithm` ("multi-layer-eagle") and `draft_model` (a draft folder,
        see docs/draft-format.md; by default the shipped draft for the default model), every
        request speculates with `num_draft_steps` draft steps (default: one per depth the
        draft has; steps beyond its depths run its last depth again) unless
        `generate(..., speculative=False)` opts it out. With `num_draft_chains` N > 1, greedy
        requests draft N chains that start with depth 0's N most likely tokens, and
        each step keeps the one the target accepts furthest (output unchanged); by default 1.
        With `speculative_topk` k > 1 every request drafts a token tree instead
        (spec/runtime/tree.py): each expanded node proposes its k likeliest children, k nodes are
        expanded per level, and the `num_draft_tokens` likeliest nodes (default k x depths) are
        verified at once. `draft_vocab`: "draft" proposes only from the vocabulary a draft folder
        ships (fewer LM-head rows a depth, which a CPU needs), "full" from the target's whole
        vocabulary (longer accepts); default: "full" on a GPU, "draft" elsewhere.
        `speculative_plan`: "adaptive" (default) speculates at a step only where a round is
        measured to commit more tokens a second than a plain step at that batch size (the
        running accept length against the cost of a round over a plain step, learned as the
        engine runs; spec/runtime/round_plan.py), "always" at every step; at
        `speculative_disable_batch_size` running requests or more, every step is plain.
        `debug_tensor_dump_dir` dumps every forward pass (engine/executor/debug_dump.py) under
        DIR/offline/<target|draft-N>/rank<r>/ (r: the tensor parallel rank), keeping only
        `debug_tensor_dump_layers` if given.
        Prompts longer than `chunked_prefill_size` tokens are prefilled in chunks of it, in or
        between decode steps of the running requests (0: in one step; default 2048 on a CPU,
        4096 on a GPU).
        `max_tokens_cap`: refuse (RequestRejectedError) a request asking for more max_tokens.
        `attention_backend`: "triton" (GPU), "torch" (anywhere) or "auto" (triton on a GPU).
        On a GPU, decode steps of up to `cuda_graph_max_bs` requests (default max_num_seqs)
        replay CUDA graphs captured here, unless `disable_cuda_graph` or a tensor dump; so do
        prefill steps of up to `cuda_graph_max_prefill_tokens` tokens (default 512; 0: none).
        `overlap_schedule`: prepare each plain decode step while the device runs the one
        before (engine/executor/overlap.py); default on a GPU, off on a CPU.
        `mixed_prefill`: a step that admits prompts while others run decodes the running
        requests in the same forward (default); False gives admission steps of their own.
        `enable_prefix_cache`: reuse the KV of the longest cached prefix of each prompt
        (engine/scheduling/prefix_cache.py; default); off by itself where the engine speculates.
        `gpu_memory_utilization`: the fraction of the GPU's total memory this engine may take,
        for engines that share a GPU (default: the KV pool takes 80% of what is free).
        `enable_tracing` gives each output its timeline (`RequestOutput.trace`, engine.tracing).
        `speculation`: the speculative algorithm's implementation (engine.speculation), for an
        engine other than the one registered under `speculative_algorithm`.
        `tensor_parallel_size` N > 1 splits the model over N ranks on this host, this process
        and N - 1 processes it starts (docs/tensor-parallel.md; CPU only, no speculation so
        far); `close()` ends them, as does collecting the LLM or this process ending."""
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        self.args = EngineArgs(
            model=model_path_arg(model),
            dtype=dtype or "auto",
            device=device,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_tokens_cap=max_tokens_cap,
            kv_cache_tokens=kv_cache_tokens,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=chunked_prefill_size,
            gpu_memory_utilization=gpu_memory_utilization,
            attention_backend=attention_backend,
            disable_cuda_graph=disable_cuda_graph,
            cuda_graph_max_bs=cuda_graph_max_bs,
            cuda_graph_max_prefill_tokens=cuda_graph_max_prefill_tokens,
            overlap_schedule=overlap_schedule,
            mixed_prefill=mixed_prefill,
            enable_prefix_cache=enable_prefix_cache,
            seed=seed,
            speculative_algorithm=speculative_algorithm,
            draft_model=model_path_arg(draft_model),
            num_draft_steps=num_draft_steps,
            num_draft_chains=num_draft_chains,
            speculative_topk=speculative_topk,
            num_draft_tokens=num_draft_tokens,
            draft_vocab=draft_vocab,
            speculative_plan=speculative_plan,
            speculative_disable_batch_size=speculative_disable_batch_size,
            debug_tensor_dump_dir=model_path_arg(debug_tensor_dump_dir),
            debug_tensor_dump_layers=(
                None if debug_tensor_dump_layers is None else tuple(debug_tensor_dump_layers)
            ),
            tensor_parallel_size=tensor_parallel_size,
        )
        built = build_engine(self.args, speculation, tracing=enable_tracing)
        self.model_path = built.spec.path
        self.tokenizer = built.spec.tokenizer
        self.model_config = built.spec.model_config
        self.config = built.spec.engine_config
        self.engine = built.core
        self._ids = itertools.count()

    def close(self) -> None:
        """Release what the engine holds outside this process (tensor parallel ranks); the LLM
        cannot generate afterwards. Idempotent."""
        self.engine.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        speculative: bool | Sequence[bool] = True,
        prompt_embeds: EmbedsArg | Sequence[EmbedsArg | None] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings or token-id lists; outputs come back in the same order. With
        `SamplingParams(n=N)` a prompt gives N outputs in a row (output i * N + s is sample s
        of prompt i, the order of the OpenAI API's choices), sample s drawn with
        `params.for_sample(s)`.
        `speculative` (one flag, or one per prompt) lets requests opt out of speculation.
        `prompt_embeds` ({position: vector} or PromptEmbeds, one or one per prompt, None for
        none) gives vectors that replace the embeddings of those prompt tokens."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        embeds = per_prompt(prompt_embeds, len(token_lists))
        return self._run(token_lists, sampling_params, speculative, embeds)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Each conversation is a list of {"role", "content"} messages; the model's chat
        template turns it into a prompt that ends where the assistant's answer starts."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        token_lists = [self.apply_chat_template(c) for c in conversations]
        return self._run(token_lists, sampling_params)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def _run(
        self,
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        speculative: bool | Sequence[bool] = True,
        prompt_embeds: list[PromptEmbeds | None] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(token_lists)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(token_lists):
                raise ValueError(
                    f"{len(params_list)} SamplingParams for {len(token_lists)} prompts"
                )
        flags = [speculative] * len(token_lists) if isinstance(speculative, bool) else speculative
        if len(flags) != len(token_lists):
            raise ValueError(f"{len(flags)} speculative flags for {len(token_lists)} prompts")
        # Validate everything before running anything, so one bad prompt costs no work.
        embeds = prompt_embeds or [None] * len(token_lists)
        groups = [
            [
                self.engine.make_request(
                    str(next(self._ids)), tokens, params.for_sample(sample), flag, given
                )
                for sample in range(params.n)
            ]
            for tokens, params, flag, given in zip(token_lists, params_list, flags, embeds)
        ]
        # A prompt's n samples share one prefill of it (EngineCore.add_samples).
        for samples in groups:
            self.engine.add_samples(samples)
        requests = [req for samples in groups for req in samples]
        while self.engine.has_work():
            set_time_batch(self.engine.step(), "finish")
        failed = [req for req in requests if req.error is not None]
        if failed:
            raise PdclusterError(f"{len(failed)} request(s) failed, first: {failed[0].error}")
        return [self.engine.output(req) for req in requests]
