"""A draft vocabulary: the target tokens a draft may propose, and the LM head restricted to them.

Every draft depth ends in the target's LM head. For a small target that head is a large share of
a depth's cost (SmolLM2-135M: 49,152 x 576, a fifth of the target's weights), yet a chat model
emits a few thousand distinct tokens almost all of the time. With a draft vocabulary (EAGLE-3's
draft-to-target map) each depth multiplies by those rows alone and maps its argmax back to a
target id. Output is unchanged: verification is the target's, and a token outside the
vocabulary is simply never proposed."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.kernels import triton_usable
from engine.models.llama import LlamaForCausalLM


def count_tokens(sequences: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in `sequences`: [vocab_size] int64."""
    ids = torch.tensor([t for seq in sequences for t in seq], dtype=torch.int64)
    return torch.bincount(ids, minlength=vocab_size)


def choose_draft_vocab(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids (lower id first among equal counts), `always` among
    them (the ids that end a turn: a draft that cannot propose the end would never be right
    there), in ascending order."""
    vocab_size = counts.shape[0]
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    forced = sorted({int(t) for t in always})
    if any(not 0 <= t < vocab_size for t in forced):
        raise ValueError(f"token ids {forced} are not all below the vocabulary size {vocab_size}")
    if len(forced) > size:
        raise ValueError(f"{len(forced)} tokens must be in a draft vocabulary of {size}")
    # A stable sort by count keeps lower ids first among ties, so the choice is reproducible.
    order = torch.sort(counts, descending=True, stable=True).indices.tolist()
    chosen = set(forced)
    for token in order:
        if len(chosen) == size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def coverage(counts: torch.Tensor, vocab: torch.Tensor) -> float:
    """The share of the counted tokens that `vocab` holds."""
    total = int(counts.sum())
    return float(counts[vocab].sum()) / total if total else 1.0


def check_draft_vocab(vocab: torch.Tensor, vocab_size: int) -> str | None:
    """Why `vocab` is not a valid draft vocabulary of a target with `vocab_size` tokens, or
    None: it must be non-empty, int64, strictly ascending and within the target's ids."""
    if vocab.dtype != torch.int64 or vocab.dim() != 1 or vocab.numel() == 0:
        shape = tuple(vocab.shape)
        return f"must be a non-empty 1-D int64 tensor, got {vocab.dtype} of shape {shape}"
    if not bool((vocab[1:] > vocab[:-1]).all()):
        return "must list distinct token ids in ascending order"
    if int(vocab[0]) < 0 or int(vocab[-1]) >= vocab_size:
        return f"holds ids outside the target's 0..{vocab_size - 1}"
    return None


class DraftHead:
    """The target's final norm and LM head, restricted to a draft vocabulary if one is given:
    what every depth's output goes through to propose a token."""

    def __init__(self, target: LlamaForCausalLM, vocab: torch.Tensor | None) -> None:
        self.target = target
        self.vocab = vocab
        self.weight = None
        if vocab is not None:
            self.vocab = vocab.to(target.model.embed_tokens.weight.device)
            full = head_weight(target)
            # Without the plain weight (an untied head packed for the CPU) the head still runs
            # whole and is indexed afterwards: the same tokens, without the saving.
            if full is not None:
                self.weight = full.index_select(0, self.vocab).contiguous()

    def propose(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, hidden_size] -> (token ids [B] in the target's vocabulary, each one's
        probability under the draft's distribution over its vocabulary)."""
        best, best_p = self.propose_top(hidden, 1)
        return best[:, 0], best_p[:, 0]

    def propose_top(self, hidden: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, hidden_size] -> (the `n` most likely token ids [B, n] in the target's
        vocabulary, most likely first; their probabilities [B, n]), from one evaluation of the
        head."""
        if triton_usable(hidden):
            from engine.kernels.topk import MAX_K, topk_with_probability

            if n <= MAX_K:
                logits = self._logits(hidden, as_float=False)
                return topk_with_probability(logits, min(n, logits.shape[-1]), self.vocab)
        probs = torch.softmax(self._logits(hidden), dim=-1)
        if n == 1:  # one reduction, where a top-k over the vocabulary sorts in several passes
            top_p, top = probs.max(dim=-1, keepdim=True)
        else:
            top_p, top = probs.topk(min(n, probs.shape[-1]), dim=-1)
        if self.vocab is not None:
            top = self.vocab[top]
        return top, top_p

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The proposed token ids (target ids) alone, for hidden [..., hidden_size]."""
        best = self._logits(hidden).argmax(dim=-1)
        return best if self.vocab is None else self.vocab[best]

    def _logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor:
        """The draft vocabulary's logits, in float32 or (not `as_float`) the model's dtype; the
        whole head's, then indexed, where the head has no plain weight to restrict."""
        if self.vocab is None:
            if as_float:
                return self.target.lm_head_logits(hidden)
            logits = self.target.lm_head_outputs(hidden)
        elif self.weight is None:
            return self.target.lm_head_logits(hidden)[..., self.vocab]
        else:
            logits = self.target.cap_logits(
                nn.functional.linear(self.target.model.norm(hidden), self.weight)
            )
        return logits.float() if as_float else logits


def head_weight(target: LlamaForCausalLM) -> torch.Tensor | None:
    """The LM head's [vocab, hidden] weight, or None where the head keeps only a packed form."""
    weight = getattr(target.lm_head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight
    if target.config.tie_word_embeddings:
        return target.model.embed_tokens.weight
    return None
