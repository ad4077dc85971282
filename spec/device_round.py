"""A decode step's whole speculative round queued on the device, read by the host once.

The general round reads the verify's targets on the host, walks each request's chain there,
then queues the draft extend and reads its chains: two waits for the device a step, and the
host's acceptance walk between them while the device idles. For greedy requests whose logits
need no processing (no penalty, bias, min_tokens or grammar), that speculate one full chain
and whose draft state the fixed-shape extend runs (spec/decode_extend.py), acceptance is a
comparison on the device: the accepted count is the length of the prefix where the chain
equals the target's argmax. The extend reads the targets and the counts where they are, so
verify, acceptance and extend are queued back to back, and one copy brings the round home:
each request's targets, its accepted count, its next chain and that chain's probabilities.

The extend then runs before the host commits: a request that the round ends (EOS, a stop
string) has drafted a chain it will not use, and its draft KV is freed with its target KV.
Output and statistics are those of the general round: acceptance is the same rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.request import Request
from engine.step_sampling import samples_from_logits_alone
from spec.decode_extend import FixedDecodeExtend, FixedExtendItem


def runs_on_device(requests: list[Request], k: int) -> bool:
    """Whether every request's round can be decided on the device (see the module's doc), for
    an engine that drafts chains; the fixed extend's own conditions are
    `FixedDecodeExtend.fits`'s."""
    return all(
        req.lookahead == k and req.params.greedy and samples_from_logits_alone(req)
        for req in requests
    )


@dataclass
class DeviceRound:
    """A round read back from the device: per request its committed tokens (accepted drafts
    and the target's token) and accepted count; the extend's items and next chains, applied
    once the tokens are committed (`FixedDecodeExtend.apply`)."""

    tokens: list[list[int]]
    accepted: list[int]
    items: list[FixedExtendItem]
    chains: list[list[float]]  # per request its next chain, then the chain's probabilities
    boundary: torch.Tensor  # [K-1, n, hidden]
    last_hidden: torch.Tensor  # [n, width]: the target's at each newest position after it


def placeholder_items(requests: list[Request], k: int) -> list[FixedExtendItem]:
    """The extend's items before the verify ran: committed tokens and hidden states are filled
    on the device (`FixedDecodeExtend.launch`); these serve `fits` and the host's inputs."""
    empty = torch.empty(k + 1, 0)
    return [
        FixedExtendItem(req.spec_state, req.num_tokens - 1, [0] * (k + 1), empty)
        for req in requests
    ]


def run_device_round(
    forward: ForwardBatch,
    forward_every_token,
    requests: list[Request],
    items: list[FixedExtendItem],
    fixed_extend: FixedDecodeExtend,
    k: int,
) -> DeviceRound:
    """Verify `forward` (each request's newest token and chain of `k` drafts, in request
    order), accept on the device, extend over `items` (`placeholder_items` of the requests,
    which `FixedDecodeExtend.fits`), and read everything back in one copy."""
    logits, hidden = forward_every_token(forward)
    n = len(requests)
    targets = logits.argmax(dim=-1).view(n, k + 1)
    # Each request's span is its newest token then its chain: the chains are on the device.
    chains = forward.input_ids[: n * (k + 1)].view(n, k + 1)[:, 1:]
    accepted = (targets[:, :k] == chains).long().cumprod(dim=1).sum(dim=1)
    hidden = hidden.view(n, k + 1, -1)
    next_chains, next_probs, boundary, last_hidden = fixed_extend.launch(
        items, targets, accepted, hidden
    )
    # One copy for the whole round (ids are exact in float64).
    host = torch.cat(
        [targets.double(), accepted.double()[:, None], next_chains.double(), next_probs.double()],
        dim=1,
    ).tolist()
    tokens, counts, rounds = [], [], []
    for row in host:
        count = int(row[k + 1])
        tokens.append([int(t) for t in row[: count + 1]])
        counts.append(count)
        rounds.append(row[k + 2 :])
    return DeviceRound(tokens, counts, items, rounds, boundary, last_hidden)
