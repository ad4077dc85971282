"""Owns the model, its KV pools and attention backend on one device; turns scheduled requests
into a ForwardBatch and returns last-position logits. With a `ModelShard` (tensor parallelism,
engine/tensor_parallel/) it owns one rank's part: the model's shard, the attention over the
rank's heads and a KV pool of the rank's KV heads only; logits still come back whole."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from engine.attention import AttentionBackend, create_attention_backend
from engine.config import EngineConfig
from engine.executor.cuda_graph import CudaGraphs
from engine.executor.debug_dump import TARGET_ROLE, dump_pass, tensor_dumper
from engine.executor.forward_batch import ForwardBatch, Span, extend_batch
from engine.executor.graph_inputs import batch_size_buckets, token_buckets
from engine.executor.prompt_embeds import InputEmbeds
from engine.model_config import ModelConfig
from engine.models import model_class
from engine.models.cpu_linear import pack_linears, packed_linear_available
from engine.models.llama import LlamaForCausalLM
from engine.models.rope import RotaryEmbedding
from engine.request import Request
from engine.sampling.verify_outputs import ChainVerdicts, VerifyOutputs
from engine.scheduling.kv_pool import KVPool, ReqToTokenPool
from engine.tensor_parallel.kv_links import KVLinks
from engine.tensor_parallel.layers import ModelShard
from engine.tensor_parallel.link_orders import LinkOrder, RankStatus, run_link_order


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, vocab] float32 at each request's last new token
    last_hidden: torch.Tensor  # [B, spec_hidden_size] the draft's input there (see `hidden`)
    # [T, spec_hidden_size] at every new token, when asked for: the draft model's input.
    hidden: torch.Tensor | None = None
    # With `hidden`, when the batch gave input embeddings: the rows the target read in place of
    # token embeddings, [T] (the draft's prefill reads them too).
    input_embeds: InputEmbeds | None = None


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        shard: ModelShard | None = None,
    ) -> None:
        self.model_config = model_config
        self.config = engine_config
        self.shard = shard
        self.device = torch.device(engine_config.device)
        self.model = build_model(model_config, engine_config, weights, shard)
        # The heads this runner attends with and caches: all of them, or its rank's.
        local = model_config if shard is None else shard.local_config(model_config)
        self.rotary = RotaryEmbedding(
            model_config.rope,
            model_config.head_dim,
            max(engine_config.max_model_len, model_config.max_position_embeddings),
            self.device,
        )
        self.attention = create_attention_backend(
            engine_config.attention_backend,
            local.num_heads,
            local.num_kv_heads,
            model_config.head_dim,
        )
        self.kv_pool = KVPool(
            engine_config.kv_cache_tokens,
            model_config.num_layers,
            local.num_kv_heads,
            model_config.head_dim,
            engine_config.dtype,
            self.device,
        )
        self.req_to_token_pool = ReqToTokenPool(
            engine_config.max_num_seqs,
            engine_config.max_model_len,
            self.device,
        )
        self.dumper = tensor_dumper(engine_config.tensor_dump, TARGET_ROLE, self.model)
        self.graphs: CudaGraphs | None = None
        self.verify_graphs: CudaGraphs | None = None
        self.prefill_graphs: CudaGraphs | None = None
        if engine_config.cuda_graph_max_prefill_tokens:
            # Captured first: the decode graphs then share what is left of the memory pool.
            self.prefill_graphs = CudaGraphs(
                "prefill",
                self._prefill_outputs,
                self.attention,
                self.kv_pool,
                self.req_to_token_pool,
                token_buckets(engine_config.cuda_graph_max_prefill_tokens),
                max_span=engine_config.cuda_graph_max_prefill_tokens,
                request_outputs=2,
                embeds_width=model_config.hidden_size,
            )
            self.prefill_graphs.capture()
        if engine_config.cuda_graph_max_bs:
            self.graphs = CudaGraphs(
                "decode",
                self._every_token_outputs,
                self.attention,
                self.kv_pool,
                self.req_to_token_pool,
                batch_size_buckets(engine_config.cuda_graph_max_bs),
                max_span=1,
            )
            self.graphs.capture()

    def vocabulary_model(self) -> LlamaForCausalLM:
        """The model whose token embedding, final norm and LM head cover the whole vocabulary
        in this process: what a speculative draft embeds its tokens with and proposes through
        (this runner's own model; a tensor parallel rank 0's whole copy of those three)."""
        return self.model

    def run_link_order(self, order: LinkOrder, links: KVLinks) -> list[RankStatus]:
        """Do `order` on this process's KV links (`links`, over this runner's pool; a tensor
        parallel rank 0 has every rank do it on its own): each rank's status, by rank."""
        return [run_link_order(links, order, 0)]

    def lost_rank(self) -> str | None:
        """Why this runner can run no forward (a tensor parallel rank that has exited), or
        None; cheap enough for a health probe (a runner on one device loses none)."""
        return None

    def close(self) -> None:
        """Release what this runner holds outside its process (a tensor parallel engine's
        follower ranks); a runner on one device holds nothing there."""

    def capture_verify_graphs(
        self, max_span: int, trees: bool = False, verdicts: ChainVerdicts | None = None
    ) -> None:
        """Capture graphs for forwards whose requests each bring at most `max_span` tokens
        (speculative verify: the newest token and a draft chain, or with `trees` a draft token
        tree), up to cuda_graph_max_bs requests. No-op when this engine runs no graphs. With
        `verdicts` (chains), the replay also decides their acceptance: the host reads one
        small block, with no call into torch for it (engine.sampling.verify_outputs)."""
        max_requests = self.config.cuda_graph_max_bs
        if not max_requests:
            return
        run = self._every_token_outputs
        if verdicts is not None:
            run = partial(self._chain_outputs, width=max_span, verdicts=verdicts)
        self.verify_graphs = CudaGraphs(
            "verify",
            run,
            self.attention,
            self.kv_pool,
            self.req_to_token_pool,
            token_buckets(max_requests * max_span),
            max_span=max_span,
            request_outputs=0 if verdicts is None else 1,
            trees=trees,
        )
        self.verify_graphs.capture()

    def graph_batch(self, spans: list[Span]) -> ForwardBatch | None:
        """A batch of these spans in the verify graphs' buffers, or None where no captured
        graph runs them (too many tokens, too long a span)."""
        if self.verify_graphs is None or not self.verify_graphs.fits(spans):
            return None
        return self.verify_graphs.load(spans)

    def uniform_graph_batch(
        self, rows: np.ndarray, starts: np.ndarray, tokens: np.ndarray, slots: np.ndarray
    ) -> ForwardBatch | None:
        """`graph_batch` of causal spans that all bring the same number of tokens, given as
        arrays (`CudaGraphs.load_uniform`): a speculative round's verify of full chains."""
        graphs = self.verify_graphs
        if graphs is None or not graphs.fits_uniform(*tokens.shape):
            return None
        return graphs.load_uniform(rows, starts, tokens, slots)

    def span_batch(self, spans: list[Span], graphs: CudaGraphs | None = None) -> ForwardBatch:
        """A batch of explicit spans: in the buffers of `graphs` (by default the decode
        graphs) where one of them holds it, else eager."""
        graphs = self.graphs if graphs is None else graphs
        if graphs is not None and graphs.fits(spans):
            return graphs.load(spans)
        return extend_batch(
            spans,
            self.kv_pool,
            self.req_to_token_pool,
            self.attention,
            self.device,
            self.config.dtype,
        )

    def build_batch(self, requests: list[Request], ends: list[int] | None = None) -> ForwardBatch:
        """Each request extends its cached prefix (`kv_len`) to all of its tokens (a decode
        step), or to `ends[i]` (a prefill step: a prompt or its chunk). A batch that a captured
        graph holds goes into the graph's static buffers: decode graphs hold one new token a
        request (never one given as a vector), prefill graphs up to their token count."""
        spans = [
            Span(
                req.row,
                req.kv_len,
                req.token_ids(req.kv_len, end),
                req.slots[req.kv_len : end],
                req.prompt_embeds.rows(req.kv_len, end) if req.prompt_embeds else None,
            )
            for req, end in zip(requests, ends or [req.num_tokens for req in requests])
        ]
        return self.span_batch(spans, self.graphs if ends is None else self.prefill_graphs)

    def _prefill_outputs(
        self, batch: ForwardBatch, _hidden_input: None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a prefill graph computes: the draft's input at every token, then the logits
        and the draft's input at each request's last token (padded columns included)."""
        hidden, draft_hidden = self._run_model(batch)
        last = batch.last_token_indices()
        return draft_hidden, self.model.compute_logits(hidden[last]), draft_hidden[last]

    def _every_token_outputs(
        self, batch: ForwardBatch, _hidden_input: None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a graph computes: logits and the draft's input at every token (the target takes
        no hidden input, unlike a draft depth)."""
        hidden, draft_hidden = self._run_model(batch)
        return self.model.compute_logits(hidden), draft_hidden

    def _chain_outputs(
        self,
        batch: ForwardBatch,
        _hidden_input: None = None,
        *,
        width: int,
        verdicts: ChainVerdicts,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a graph of chain verifies computes: `_every_token_outputs`, then each span's
        greedy verdicts as if the batch were spans of `width` tokens (what a uniform load
        gives; meaningless for other loads, whose callers do not read them)."""
        logits, draft_hidden = self._every_token_outputs(batch)
        return logits, draft_hidden, verdicts(logits, batch.input_ids, width)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, keep_hidden: bool = False) -> ForwardOutput:
        if batch.graph is not None and batch.graph is self.prefill_graphs:
            every, logits, last_hidden = batch.graph.replay(batch)
            if not keep_hidden:
                return ForwardOutput(logits, last_hidden)
            # What the draft's prefill reads outlives the next replay: out of the buffers,
            # sliced to the real tokens (replay slices them), the input vectors too.
            embeds = batch.graph.embeds_used(batch.num_tokens)
            return ForwardOutput(logits, last_hidden.clone(), every.clone(), embeds)
        if batch.graph is not None:
            logits, draft_hidden = batch.graph.replay(batch)
            if not keep_hidden:
                return ForwardOutput(logits, draft_hidden)
            # Kept hidden states outlive the next replay: out of the graph's buffer.
            draft_hidden = draft_hidden.clone()
            return ForwardOutput(logits, draft_hidden, draft_hidden, None)
        with dump_pass(self.dumper, batch):
            hidden, draft_hidden = self._run_model(batch)
            last = batch.last_token_indices()
            logits = self.model.compute_logits(hidden[last])
        last_hidden = draft_hidden[last]
        if not keep_hidden:
            return ForwardOutput(logits, last_hidden)
        return ForwardOutput(logits, last_hidden, draft_hidden, self._input_embeds_used(batch))

    def _run_model(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return run_target(self.model, batch, self.rotary, self.attention)

    def _input_embeds_used(self, batch: ForwardBatch) -> InputEmbeds | None:
        """The input-embedding rows this forward read, sliced to the batch's real token count
        (built in the model's dtype, so exactly what the model used). A CUDA graph runner pads
        the batch into static buffers: it must copy these rows out of its input buffer, sliced
        the same way, or the draft would read padding or the next replay's rows."""
        if batch.input_embeds is None:
            return None
        num_tokens = batch.num_tokens
        return InputEmbeds(batch.input_embeds[:num_tokens], batch.input_embeds_mask[:num_tokens])

    @torch.inference_mode()
    def forward_every_token(self, batch: ForwardBatch) -> VerifyOutputs:
        """Logits [T, vocab] and hidden states [T, spec_hidden_size] at every new token: what
        speculative verify needs, since it checks a draft token at each position; and a graph
        of chains' greedy verdicts. Logits and verdicts from a graph are views of its
        buffers, valid until the next replay of a verify graph."""
        if batch.graph is not None:
            logits, hidden, *verdicts = batch.graph.replay(batch)
            # The draft reads the hidden states after the next replay may have begun (a
            # boundary state kept for the next step): they leave the graph's buffer.
            return VerifyOutputs(logits, hidden.clone(), verdicts[0] if verdicts else None)
        with dump_pass(self.dumper, batch):
            hidden, draft_hidden = self._run_model(batch)
            return VerifyOutputs(self.model.compute_logits(hidden), draft_hidden)


def run_target(
    model: LlamaForCausalLM,
    batch: ForwardBatch,
    rotary: RotaryEmbedding,
    attention: AttentionBackend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the LM head reads, and the draft's input [T, spec_hidden_size]: the outputs of the
    draft's auxiliary layers side by side (EAGLE3 style), or the same last output. The draft
    trainer runs the target through this too, so it trains on what the engine hands the draft."""
    aux_layers = model.config.draft_aux_layers
    hidden, captured = model.forward_layers(batch, rotary, attention, aux_layers)
    return hidden, torch.cat(captured, dim=-1) if aux_layers else hidden


def build_model(
    model_config: ModelConfig,
    engine_config: EngineConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    shard: ModelShard | None = None,
) -> LlamaForCausalLM:
    """The model, or with `shard` one rank's part of it, loaded from `weights` (the whole
    checkpoint's HF-named tensors: a shard slices each as it streams past)."""
    config = model_config
    if shard is not None:
        config, weights = shard.local_config(model_config), shard.weights(weights)
    # Build on the meta device so no memory is spent on a random initialisation that the
    # checkpoint overwrites anyway.
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to_empty(device=engine_config.device).to(engine_config.dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_weights(weights)
    if engine_config.cpu_packed_linear and packed_linear_available(
        torch.device(engine_config.device), engine_config.dtype
    ):
        pack_linears(model)
    if shard is not None:
        # Wrapped after packing, which replaces the linears the wrappers hold.
        shard.parallelize(model)
    return model.eval()
