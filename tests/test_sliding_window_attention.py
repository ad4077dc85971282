"""Sliding-window attention in both backends, against dense float32 attention with the window:
a query at rotary position p sees only the cached positions above p - W, in batched decode,
prompts, a chunk after a cached prefix, verify spans, mixed batches and a draft tree's verify
(whose nodes keep the window of their rotary positions); a backend without windows refuses a
windowed layer by name. The models that use windows: tests/test_gemma3.py."""

from __future__ import annotations

import pytest
import torch
from test_attention_backend import HEAD_DIM, _assign_rows, _batch, _new_tokens, _pools

from engine import UnsupportedModelError
from engine.attention import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.executor.forward_batch import Span, tree_bits


def _backends(device: str) -> list[type[AttentionBackend]]:
    """The torch backend, and on CUDA the Triton one too."""
    if device == "cpu":
        return [TorchAttentionBackend]
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.attention.triton_backend import TritonAttentionBackend

    return [TorchAttentionBackend, TritonAttentionBackend]


WINDOW_CASES = {
    # name: (seq_lens, extend_lens, window)
    "decode": ([1, 17, 5, 40, 33], [1, 1, 1, 1, 1], 8),
    "prompts": ([9, 40, 1], [9, 40, 1], 6),
    "chunk after a prefix": ([30, 50], [12, 20], 7),
    "verify": ([8, 20, 33, 4], [4, 4, 4, 4], 5),
    "mixed": ([4, 25, 60, 2, 13], [4, 1, 7, 2, 13], 9),
    "window of one": ([12, 30], [3, 30], 1),
}


def _windowed_reference(
    q, kv_pool, layer, slots, seq_lens, extend_lens, positions, window, tree_bits=None
):
    """Dense float32 attention where the query at rotary position p of a request sees the
    cached positions c <= its own cache position with c > p - window (and, in a token tree, of
    its span only the tokens its bits name)."""
    out, token = [], 0
    group = q.shape[1] // kv_pool.num_kv_heads
    for request_slots, seq_len, new in zip(slots, seq_lens, extend_lens):
        kv = kv_pool.kv_buffer[torch.tensor(request_slots, device=q.device), layer].float()
        keys, values = (kv[:, i].repeat_interleave(group, dim=1) for i in (0, 1))
        cache = torch.arange(seq_len - new, seq_len, device=q.device)
        rotary = positions[token : token + new]
        key_positions = torch.arange(seq_len, device=q.device)
        visible = (key_positions <= cache[:, None]) & (key_positions > rotary[:, None] - window)
        if tree_bits is not None:
            offsets = key_positions - (seq_len - new)
            bits = tree_bits[token : token + new, None]
            visible &= (offsets < 0) | ((bits >> offsets.clamp(0, 62)) & 1).bool()
        scores = torch.einsum("thd,khd->htk", q[token : token + new].float(), keys)
        scores = scores * HEAD_DIM**-0.5 + torch.where(visible, 0.0, float("-inf"))
        out.append(torch.einsum("htk,khd->thd", scores.softmax(-1), values))
        token += new
    return torch.cat(out)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("case", sorted(WINDOW_CASES))
def test_each_backend_honours_the_window(case: str, device: str) -> None:
    """Every attention path of both backends (batched decode and short extends, one SDPA call per
    request after a prefix or without one, mixed batches; the Triton kernel with and without key
    splits) against dense attention with the window."""
    backends = _backends(device)
    seq_lens, extend_lens, window = WINDOW_CASES[case]
    num_heads, num_kv_heads = 6, 2
    kv_pool, req_pool = _pools(num_kv_heads, seed=4, device=device)
    rows, slots = _assign_rows(req_pool, seq_lens, seed=2)
    q, k, v = _new_tokens(sum(extend_lens), num_heads, num_kv_heads, seed=3, device=device)
    for backend_class in backends:
        backend = backend_class(num_heads, num_kv_heads, HEAD_DIM)
        batch = _batch(kv_pool, req_pool, rows, slots, seq_lens, extend_lens)
        batch.attn_metadata = backend.prepare(batch)
        out = backend.forward(q, k, v, 1, batch, window=window)
        expected = _windowed_reference(
            q, kv_pool, 1, slots, seq_lens, extend_lens, batch.positions, window
        )
        torch.testing.assert_close(out.float(), expected, atol=2e-4, rtol=2e-4)
        # The layers of full attention in the same forward keep their own metadata.
        full = backend.forward(q, k, v, 1, batch)
        assert not torch.allclose(full, out, atol=1e-3)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_draft_trees_verify_keeps_the_window_of_each_nodes_position(device: str) -> None:
    """A tree's node attends from its rotary position (the span's first position plus its
    level), not its cache position: the window reaches as far back as for the target alone."""
    backends = _backends(device)
    # The root (the newest token), two children, a grandchild under each.
    visible, levels = [1, 0b11, 0b101, 0b1011, 0b10101], [0, 1, 1, 2, 2]
    seq_lens, extend_lens, window = [30, 9], [5, 1], 6
    num_heads, num_kv_heads = 4, 2
    kv_pool, req_pool = _pools(num_kv_heads, seed=5, device=device)
    rows, slots = _assign_rows(req_pool, seq_lens, seed=3)
    q, k, v = _new_tokens(sum(extend_lens), num_heads, num_kv_heads, seed=6, device=device)
    spans = [Span(rows[0], 25, [0] * 5, slots[0][25:], visible=visible), Span(rows[1], 8, [0], [0])]
    for backend_class in backends:
        backend = backend_class(num_heads, num_kv_heads, HEAD_DIM)
        batch = _batch(kv_pool, req_pool, rows, slots, seq_lens, extend_lens)
        batch.positions = torch.tensor([25 + level for level in levels] + [8], device=device)
        batch.tree_bits = torch.tensor(tree_bits(spans), device=device)
        batch.attn_metadata = backend.prepare(batch)
        out = backend.forward(q, k, v, 0, batch, window=window)
        expected = _windowed_reference(
            q, kv_pool, 0, slots, seq_lens, extend_lens, batch.positions, window, batch.tree_bits
        )
        torch.testing.assert_close(out.float(), expected, atol=2e-4, rtol=2e-4)


def test_a_backend_without_windows_refuses_a_sliding_layer() -> None:
    class Plain(AttentionBackend):
        def prepare(self, batch):
            return None

        def forward(self, q, k, v, layer, batch):
            return q

    q = torch.zeros(1, 4, 16)
    cos, sin = torch.ones(1, 1, 16), torch.zeros(1, 1, 16)
    backend = Plain(4, 2, 16)
    assert backend.rotate_and_attend(q, q[:, :2], q[:, :2], cos, sin, 0, None) is not None
    with pytest.raises(UnsupportedModelError, match="Plain does not implement sliding-window"):
        backend.rotate_and_attend(q, q[:, :2], q[:, :2], cos, sin, 0, None, window=8)
