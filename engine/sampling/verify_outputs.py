"""What a speculative verify forward hands back. A graph of chain verifies also decides
acceptance in its replay, with the function the speculator gives it (`ChainVerdicts`,
spec.runtime.acceptance.chain_verdicts), where eagerly it costs the host a handful of calls into
torch a round."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

# (logits [T, vocab], input ids [T], span width) -> [T // width, width + 1] verdicts.
ChainVerdicts = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class VerifyOutputs(NamedTuple):
    logits: torch.Tensor  # [T, vocab] at every token
    hidden: torch.Tensor  # [T, spec_hidden_size]: the draft's input at every token
    # [n, K+2] per request: the target's argmax at its K+1 tokens, then its accepted count;
    # computed by a graph of chain verifies (None elsewhere; meaningful for uniform chains).
    verdicts: torch.Tensor | None = None
