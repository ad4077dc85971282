"""bench/tensor_parallel.py: its table sets each rank count's rate against one rank's at the same
batch size, and its prompts are reproducible and inside the vocabulary."""

from __future__ import annotations

from bench.tensor_parallel import prompts, table


def test_table_compares_each_rank_count_with_one_rank_at_its_batch_size() -> None:
    rows = [
        dict(ranks=1, batch_size=1, tokens_per_s=10.0, build_s=1.0),
        dict(ranks=2, batch_size=1, tokens_per_s=5.0, build_s=2.0),
        dict(ranks=1, batch_size=8, tokens_per_s=40.0, build_s=1.0),
        dict(ranks=2, batch_size=8, tokens_per_s=30.0, build_s=2.0),
    ]
    lines = table(rows).splitlines()
    assert lines[2] == "| 1 | 1 | 10.0 | 1.00x | 1.0 |"
    assert lines[3] == "| 2 | 1 | 5.0 | 0.50x | 2.0 |"
    assert lines[5] == "| 2 | 8 | 30.0 | 0.75x | 2.0 |"


def test_table_leaves_the_ratio_out_without_one_rank() -> None:
    rows = [dict(ranks=3, batch_size=1, tokens_per_s=2.0, build_s=4.0)]
    assert table(rows).splitlines()[2] == "| 3 | 1 | 2.0 |  | 4.0 |"


def test_prompts_are_reproducible_and_in_the_vocabulary() -> None:
    batch = prompts(4, 16, 100, seed=1)
    assert batch == prompts(4, 16, 100, seed=1)
    assert [len(p) for p in batch] == [16] * 4
    assert all(3 <= token < 100 for p in batch for token in p)
