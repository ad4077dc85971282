"""Shared fixtures: one tiny random Llama checkpoint per test session, and an engine over it;
for the draft-training tests, one CPU thread and a target a draft can learn."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_drafts import make_predictable_llama
from tiny_models import CHAT_TEMPLATE, make_tiny_llama, save_chat_template
from transformers import LlamaForCausalLM

from engine import LLM

# A speculating engine verifies drafts at every step unless a test asks for the adaptive plan
# (engine.env.speculative_plan_default): the rounds' tests see a round at every step, whatever
# this host's timings (Ray's nodes get it too: cluster.deploy.ray_start.forwarded_env).
os.environ.setdefault("PDCLUSTER_SPECULATIVE_PLAN", "always")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (seed 0, byte-level tokenizer, EOS id 2) saved as a HF folder."""
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_llama(path, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_path: Path) -> LlamaForCausalLM:
    """The reference: the same checkpoint loaded back by HF transformers (float32, CPU)."""
    return LlamaForCausalLM.from_pretrained(tiny_model_path).eval()


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_path: Path) -> LLM:
    """An engine with a pool large enough that nothing is ever preempted. Shared by tests, so
    tests must not rely on its unseeded random state or mutate it without restoring."""
    return LLM(str(tiny_model_path), device="cpu", kv_cache_tokens=8192, max_num_seqs=16)


TINY_BACKEND_MODEL = "tiny"


@pytest.fixture(scope="module")
def backend(tiny_model_path: Path):
    """A single-process LocalBackend over the tiny model, with a chat template, served as the
    model named TINY_BACKEND_MODEL (HTTP API and client tests)."""
    from cluster.control.local_backend import LocalBackend

    llm = LLM(str(tiny_model_path), device="cpu", max_model_len=256, kv_cache_tokens=2048)
    llm.tokenizer.chat_template = CHAT_TEMPLATE
    backend = LocalBackend(llm, model_name=TINY_BACKEND_MODEL)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def one_thread():
    """These models are tiny: on a busy shared CPU, intra-op threads waiting for one another
    make training ten times slower than one thread alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def predictable_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer tiny Llama whose next token a draft can learn, with a chat template."""
    path = tmp_path_factory.mktemp("predictable")
    make_predictable_llama(path, logit_scale=3.0)
    save_chat_template(path)
    return path
