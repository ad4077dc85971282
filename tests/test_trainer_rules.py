"""The trainer's rules on chosen inputs: batches cover every sequence within the token budget,
each depth is trained on the positions that predict answer tokens, and the replay accepts and
commits as the engine's verify steps do."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import spec.train.replay as replay_module
import spec.train.trainer as trainer_module
from spec.train.batches import Block, drafted_positions, make_batches
from spec.train.data import Sequences
from spec.train.replay import validate

# --- batches and the positions each depth is trained on --------------------------------


def test_make_batches_covers_every_sequence_within_the_token_budget() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(60)] + [700, 513, 512]
    budget = 512
    orders = {}
    for seed in (0, 1):
        for epoch in (0, 1, 2):
            batches = make_batches(lengths, budget, seed, epoch)
            assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
            for batch in batches:
                padded = max(lengths[i] for i in batch) * len(batch)
                assert padded <= budget or len(batch) == 1
            assert batches == make_batches(lengths, budget, seed, epoch)
            orders[seed, epoch] = batches
    assert orders[0, 0] != orders[0, 1] != orders[0, 2]
    assert orders[0, 0] != orders[1, 0]
    assert [len(b) for b in make_batches([600, 700], budget, 0, 0)] == [1, 1]


def test_drafted_positions_are_those_predicting_answer_tokens() -> None:
    lens, prompt_lens = [10, 7, 4], [3, 4, 4]
    block = Block(
        torch.zeros(3, 10, dtype=torch.int64), torch.tensor(lens), torch.tensor(prompt_lens)
    )
    for depth in range(3):
        mask = drafted_positions(block, depth)
        assert mask.shape == (3, 10)
        for b in range(3):
            # depth d at i predicts x[i+d+2]: it must be an answer token, inside the sequence
            expected = [prompt_lens[b] <= i + depth + 2 <= lens[b] - 1 for i in range(10)]
            assert mask[b].tolist() == expected, (depth, b)
    # By hand: a 10-token row with a 3-token prompt; depth 1 predicts x[3..9] from i = 0..6.
    assert drafted_positions(block, 1)[0].tolist() == [True] * 7 + [False] * 3
    assert not drafted_positions(block, 0)[2].any()  # a prompt with no answer


# --- the replay's rules on a draft whose proposals are chosen --------------------------


def replay(
    monkeypatch: pytest.MonkeyPatch,
    row: list[int],
    prompt_len: int,
    correct: list[set[int]],
    max_tokens: int,
):
    """validate() on one sequence, with depth d's top-1 at position i right (x[i+d+2]) exactly
    where i is in correct[d], and a token that is never right elsewhere."""
    vocab, wrong = 64, 0
    length = len(row)

    def fake_draft_forward(draft, target, rotary, tokens, target_hidden, *args):
        outputs = []
        for d, right in enumerate(correct):
            preds = [row[i + d + 2] if i in right else wrong for i in range(length)]
            outputs.append(torch.nn.functional.one_hot(torch.tensor(preds), vocab).float())
        return outputs

    monkeypatch.setattr(replay_module, "target_forward", lambda *args: (None, None))
    monkeypatch.setattr(replay_module, "draft_forward", fake_draft_forward)
    data = Sequences([row], [prompt_len], {"max_tokens": max_tokens})
    identity_head = SimpleNamespace(lm_head_logits=lambda hidden: hidden)
    draft = SimpleNamespace(num_draft_steps=len(correct), vocab=None)
    return validate(draft, identity_head, None, data, 4096, 1024, torch.device("cpu"), False)


ROW = [5, 6, 7, 10, 11, 12, 13, 14, 15]  # a 3-token prompt, then answer tokens x[3..8]


def test_replay_accepts_leading_matches_and_commits_a_bonus(monkeypatch) -> None:
    # Chain 1 from i = 2 (the prompt's last position): both drafts right, 3 tokens (x4 x5 x6).
    # Chain 2 from i = 5: depth 0 wrong, 1 token (x7). Chain 3 from i = 6: depth 0 right (x8),
    # the answer ends there, so no bonus: 1 token.
    result = replay(monkeypatch, ROW, 3, [{2, 6}, {2}], max_tokens=100)
    assert result.verify_steps == 3
    assert result.answer_tokens == 5
    assert result.accept_length == pytest.approx(5 / 3)
    assert result.acceptance == pytest.approx([2 / 3, 1 / 3])
    # Depth 0 is checked at i = 1..6 (predicting x3..x8), depth 1 at i = 0..5.
    assert result.depth_accuracy == pytest.approx([2 / 6, 1 / 6])


def test_replay_drafts_no_further_than_max_tokens_allows(monkeypatch) -> None:
    # An answer cut by max_tokens = 6: chain 2 (after 4 answer tokens) has room for one draft,
    # and the last token is a plain decode step, not a verify step.
    result = replay(monkeypatch, ROW, 3, [{2, 6}, {2}], max_tokens=6)
    assert result.verify_steps == 2
    assert result.answer_tokens == 4
    assert result.acceptance == pytest.approx([1 / 2, 1 / 2])


def test_replay_of_a_draft_that_is_never_right(monkeypatch) -> None:
    result = replay(monkeypatch, ROW, 3, [set(), set()], max_tokens=100)
    assert result.verify_steps == 5  # x4 .. x8, one per step
    assert result.accept_length == 1.0 and result.acceptance == [0.0, 0.0]


# --- the log: one record per window, each step weighted by its positions ----------------


def test_logged_window_weights_each_step_by_its_positions(monkeypatch) -> None:
    # The clock is read when the window's figures have come back from the device.
    monkeypatch.setattr(trainer_module.time, "perf_counter", lambda: 10.0)
    records = []
    trainer = SimpleNamespace(
        log=records.append, progress=trainer_module.Progress(step=20, epoch=1, elapsed_s=3.0)
    )
    window = [
        trainer_module.StepResult(torch.zeros(()), torch.tensor(stats), counts)
        for stats, counts in (
            ([[2.0, 4.0], [0.5, 0.25]], [30, 10]),
            ([[1.0, 3.0], [1.0, 0.75]], [10, 30]),
        )
    ]
    last = trainer_module.DraftTrainer._log_window(trainer, window, 1e-3, 4.0)
    (record,) = records
    assert record["loss"] == pytest.approx([(2 * 30 + 1 * 10) / 40, (4 * 10 + 3 * 30) / 40])
    assert record["accuracy"] == pytest.approx([(0.5 * 30 + 10) / 40, (0.25 * 10 + 0.75 * 30) / 40])
    assert record["positions"] == 80
    assert (record["step"], record["epoch"], record["lr"]) == (20, 1, 1e-3)
    assert record["elapsed_s"] == trainer.progress.elapsed_s == 6.0
    assert last == ([1.0, 3.0], [1.0, 0.75])
