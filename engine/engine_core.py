"""One engine step at a time: schedule, forward, sample, process. Shared by `engine.LLM` and
the serving nodes, which drive `step()` from their own loops."""

from __future__ import annotations

from typing import Any

import torch

from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.request import Request, RequestOutput, Usage
from engine.sampler import compute_logprobs, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.stopping import StopChecker
from engine.validation import validate_request


def step_generator(req: Request) -> torch.Generator | None:
    """A seeded request draws each token from a generator keyed by (seed, token index), so the
    same seed gives the same tokens whichever node or batch samples a given position."""
    if req.params.seed is None:
        return None
    key = (req.params.seed * 0x9E3779B97F4A7C15 + len(req.output_token_ids)) % (2**63)
    return torch.Generator().manual_seed(key)


class EngineCore:
    def __init__(self, runner: ModelRunner, tokenizer: Any) -> None:
        config = runner.config
        self.runner = runner
        self.tokenizer = tokenizer
        self.kv_cache = KVCacheManager(runner.kv_pool, runner.req_to_token_pool)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.max_prefill_tokens)
        self.stop_checker = StopChecker(
            tokenizer, runner.model_config.eos_token_ids, config.max_model_len
        )
        self.default_generator = torch.Generator().manual_seed(config.seed)

    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        """Validate a request against this engine's limits; raises RequestRejectedError."""
        self._validate(prompt_token_ids, params)
        return Request(request_id, list(prompt_token_ids), params)

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        try:
            forward_batch = self.runner.build_batch(batch.requests)
            logits = self.runner.forward(forward_batch).logits
            params = [req.params for req in batch.requests]
            generators = [step_generator(req) for req in batch.requests]
            tokens = sample(logits, params, generators, self.default_generator)
            logprobs = compute_logprobs(logits, tokens, params)
        except Exception as err:  # noqa: BLE001 - any failure ends this batch, not the engine
            stage = "prefill" if batch.is_prefill else "decode"
            for req in batch.requests:
                self.scheduler.fail(req, f"{stage} forward failed: {type(err).__name__}: {err}")
            return batch.requests
        return self.scheduler.process_result(batch, tokens.tolist(), logprobs, self.stop_checker)

    def output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=self.stop_checker.final_text(req),
            finish_reason=req.finish_reason or "abort",
            usage=Usage(len(req.prompt_token_ids), len(req.output_token_ids)),
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        )

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        config = self.runner.config
        validate_request(
            prompt, params, vocab_size=self.runner.model_config.vocab_size,
            max_model_len=config.max_model_len, kv_cache_tokens=config.kv_cache_tokens,
        )
