"""The held-out replay: greedy speculative decoding replayed on held-out answers,
teacher-forced, which gives a draft's accept length without running the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.llama import LlamaForCausalLM
from engine.models.rope import RotaryEmbedding
from spec.draft_model import MultiLayerEagleDraft
from spec.draft_vocab import DraftHead
from spec.train.batches import make_batches, make_block, training_autocast
from spec.train.data import Sequences
from spec.train.dense import draft_forward, target_forward


@dataclass
class Validation:
    """Greedy speculative decoding replayed on held-out answers, teacher-forced: each verify
    step at chain position i accepts the leading depths whose top-1 equals the target's next
    tokens, commits those plus the target's bonus token, and the next chain starts after them.
    On the target's own greedy answers this is the engine's accept length (up to rounding)."""

    accept_length: float  # tokens per verify step, bonus included
    acceptance: list[float]  # per draft position j: share of verify steps that accepted it
    depth_accuracy: list[float]  # per depth: top-1 agreement at every answer position
    verify_steps: int
    answer_tokens: int


@torch.no_grad()
def validate(
    draft: MultiLayerEagleDraft,
    target: LlamaForCausalLM,
    rotary: RotaryEmbedding,
    data: Sequences,
    tokens_per_batch: int,
    max_seq_len: int,
    device: torch.device,
    autocast: bool,
) -> Validation:
    # Every step the draft runs, a reused last depth's steps included (spec.train.steps): the
    # chains have as many steps as the saved folder makes an engine run by default.
    k = draft.num_draft_steps
    # What the engine proposes with: the draft's vocabulary, if it has one.
    head = DraftHead(target, draft.vocab)
    max_tokens = data.meta.get("max_tokens") or max(len(t) for t in data.tokens)
    steps = emitted = 0
    accepted_at = [0] * k
    agree, counted = [0] * k, [0] * k
    for indices in make_batches([len(t) for t in data.tokens], tokens_per_batch, 0, 0):
        block = make_block(data, indices, max_seq_len, device)
        with training_autocast(device, autocast):
            target_hidden, _ = target_forward(target, rotary, block.tokens)
            outputs = draft_forward(draft, target, rotary, block.tokens, target_hidden)
            preds = [head.argmax(out).view_as(block.tokens) for out in outputs]
        tokens = block.tokens.tolist()
        preds_cpu = [p.tolist() for p in preds]
        for b in range(len(indices)):
            n, length = int(block.prompt_lens[b]), int(block.lens[b])
            row = tokens[b]
            for d in range(k):
                # depth d at i predicts row[i+d+2], for i+d+2 in the answer
                for i in range(max(0, n - d - 2), length - d - 2):
                    agree[d] += preds_cpu[d][b][i] == row[i + d + 2]
                    counted[d] += 1
            i = n - 1  # the first chain comes from the prefill, at the prompt's last position
            while i + 2 <= length - 1:
                remaining = length - 1 - (i + 1)  # tokens after x[i+1] still to produce
                # The engine drafts no further than max_tokens leaves room for, and a step with
                # no room for a draft is a plain decode step, not a verify step.
                lookahead = min(k, max_tokens - (i + 2 - n) - 1)
                if lookahead <= 0:
                    i += 1
                    continue
                accepted = 0
                while accepted < min(lookahead, remaining) and (
                    preds_cpu[accepted][b][i] == row[i + accepted + 2]
                ):
                    accepted += 1
                # The answer's end cuts a step short, bonus token first (as a stop does).
                committed = min(accepted + 1, remaining)
                steps += 1
                emitted += committed
                for j in range(min(accepted, committed)):
                    accepted_at[j] += 1
                i += committed
    return Validation(
        accept_length=emitted / steps if steps else 0.0,
        acceptance=[a / steps if steps else 0.0 for a in accepted_at],
        depth_accuracy=[a / c if c else 0.0 for a, c in zip(agree, counted)],
        verify_steps=steps,
        answer_tokens=emitted,
    )
