"""The draft extend for prefill of a prompt's other parallel samples: they share its KV in every
depth, as in the target, and compute only the positions their own first token changes.

Right after a prompt x_0..x_{n-1} is prefilled, each sample has its own first token x_n. Depth d
at position i reads x_{i+d+1}, and depth d-1's output at i, which read tokens up to x_{i+d}: the
positions [0, n-1-d) read the prompt alone and are the same for every sample. A sample that
follows another thus starts where an extend over x_0..x_{n-1} would have left it: depth d valid
up to n-1-d over the other's slots, and the boundary that extend would have kept (depth d's
output at n-d-2, `DraftExtend.prompt_boundary`). Its own extend over x_0..x_n then runs each
depth over [n-1-d, n-1] only, reading no prompt embeddings (every token read is x_n or a draft).

Through a cluster the same holds on the decode node: a sample reserves the carrier's slots for
the shared positions (`share_prompt`), and its transfer brings each depth's positions from
`shared_prompt_len` on, the carrier's the rest."""

from __future__ import annotations

import torch

from engine.request import Request
from spec.runtime.draft_extend import DraftExtend
from spec.runtime.draft_runner import DraftRunner, DraftSeq
from spec.runtime.state import SpecRequestState
from spec.runtime.tree import TreeShape


def shared_prompt_len(num_prompt: int, depth: int) -> int:
    """Depth `depth`'s positions whose KV the parallel samples of a prompt of `num_prompt`
    tokens share: those whose inputs are the prompt's alone."""
    return max(0, num_prompt - 1 - depth)


def share_prompt(
    depths: list[DraftRunner], source: list[DraftSeq], state: SpecRequestState, num_prompt: int
) -> None:
    """Make `state`'s sequence in every depth (each holding nothing yet) hold the `source`
    sequence's slots there for the positions that the samples of a prompt of `num_prompt`
    tokens share. Each is in `state` as soon as it is made, so that releasing the request
    frees what was taken."""
    assert not any(seq.row is not None for seq in state.seqs), "the request holds nothing yet"
    for d, (runner, seq) in enumerate(zip(depths, source)):
        state.seqs[d] = runner.share_prefix(seq, shared_prompt_len(num_prompt, d))


def sample_extend(
    depths: list[DraftRunner],
    source: DraftExtend,
    req: Request,
    target_hidden: torch.Tensor,
    shape: TreeShape,
) -> DraftExtend:
    """`req`'s extend after `source` ran (an extend with `keep_prompt_boundary`, over the same
    prompt); `target_hidden`: the target's hidden states over the prompt. The state is on
    `req` as its sequences are made, so that releasing `req` frees what was taken."""
    assert source.prompt_boundary is not None, "the source keeps the prompt's boundary"
    n = len(req.all_token_ids) - 1
    assert n == source.m and req.all_token_ids[:n] == source.tokens[:n], "one prompt"
    state = SpecRequestState([DraftSeq() for _ in depths], boundary=list(source.prompt_boundary))
    req.spec_state = state
    share_prompt(depths, source.state.seqs, state, n)
    # The last prompt position's: the hidden states start at the cached prefix, if any.
    return DraftExtend(state, req.all_token_ids, target_hidden[-1:], None, shape)
