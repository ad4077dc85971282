"""Training data the held-out set showed missing: user messages the target writes in other
languages, and second user turns it writes after its own answer (three-turn conversations),
both sampled from the model itself with a seed per candidate."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_drafts import make_predictable_llama
from tiny_models import save_chat_template

from engine import LLM
from spec.train.data import Sequences
from spec.train.pipeline import TrainDraftConfig, train_draft
from spec.train.self_prompts import (
    OPENINGS,
    OTHER_LANGUAGE_OPENINGS,
    _opening,
    self_written_followups,
    self_written_prompts,
    user_turn,
)
from spec.train.trainer import Schedule


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp("predictable")
    make_predictable_llama(path, logit_scale=3.0)
    save_chat_template(path)
    return LLM(str(path), device="cpu", max_num_seqs=8, kv_cache_tokens=2048)


class CountingLLM:
    def __init__(self, llm: LLM) -> None:
        self.llm, self.calls = llm, 0
        self.tokenizer, self.model_path = llm.tokenizer, llm.model_path

    def generate(self, prompts, params):
        self.calls += 1
        return self.llm.generate(prompts, params)


def written(llm: LLM, tmp_path: Path, n: int = 6, **kwargs) -> list:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return self_written_prompts(
        llm, n, tmp_path / "p.json", seed=3, max_tokens=16, chunk=4, progress=False, **kwargs
    )


def test_without_other_languages_the_openings_are_the_ones_before_the_option() -> None:
    for seed in range(200):
        assert _opening(random.Random(seed), 0.0) == random.Random(seed).choice(OPENINGS)


def test_other_languages_start_from_their_openings(llm: LLM, tmp_path: Path) -> None:
    others = written(llm, tmp_path / "c", other_languages=1.0)
    messages = [c[0]["content"] for c in others]
    assert all(m.startswith(OTHER_LANGUAGE_OPENINGS) for m in messages)
    with pytest.raises(ValueError, match="other_languages"):
        written(llm, tmp_path / "d", other_languages=1.5)
    # A file made with a share is not resumed without it, nor the other way round.
    with pytest.raises(ValueError, match="other settings \\(other_languages\\)"):
        written(llm, tmp_path / "c")
    written(llm, tmp_path / "e")
    with pytest.raises(ValueError, match="other settings \\(other_languages\\)"):
        written(llm, tmp_path / "e", other_languages=0.5)


def test_followups_continue_the_conversation_and_its_answer(llm: LLM, tmp_path: Path) -> None:
    first = written(llm, tmp_path)
    answers = [f"answer {i}" for i in range(len(first))]
    path = tmp_path / "f.json"
    followups = self_written_followups(
        llm, first, answers, 4, path, seed=3, max_tokens=16, chunk=3, progress=False
    )
    turn = user_turn(llm.tokenizer)
    assert 0 < len(followups) <= 4
    by_head = {c[0]["content"]: a for c, a in zip(first, answers)}
    for conversation in followups:
        user, assistant, second = conversation
        assert (user["role"], assistant["role"], second["role"]) == ("user", "assistant", "user")
        assert assistant["content"] == by_head[user["content"]]
        assert len(second["content"]) >= 8 and turn.end not in second["content"]
    # Seeded per conversation: another batching, the same set; a second call reads the file.
    again = self_written_followups(
        llm, first, answers, 4, tmp_path / "g.json", seed=3, max_tokens=16, chunk=5, progress=False
    )
    assert again == followups
    counting = CountingLLM(llm)
    assert self_written_followups(counting, first, answers, 4, path, seed=3, max_tokens=16) == (
        followups
    )
    assert counting.calls == 0  # read from the file, not written again
    with pytest.raises(ValueError, match="max_tokens"):
        self_written_followups(llm, first, answers, 4, path, seed=3, max_tokens=17)
    with pytest.raises(ValueError, match="answers"):
        self_written_followups(llm, first, answers[:2], 4, tmp_path / "h.json")


def test_the_pipeline_refuses_followups_without_their_conversations(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at most num_self_prompts"):
        TrainDraftConfig(tmp_path, num_self_prompts=2, num_self_followups=3)
    with pytest.raises(ValueError, match="share"):
        TrainDraftConfig(tmp_path, num_self_prompts=2, self_other_languages=-0.1)


def test_a_training_run_answers_its_followups_too(llm: LLM, tmp_path: Path) -> None:
    summary = train_draft(
        TrainDraftConfig(
            out_dir=tmp_path,
            model=str(llm.model_path),
            device="cpu",
            num_prompts=4,
            num_self_prompts=4,
            self_prompt_max_tokens=16,
            self_other_languages=0.5,
            num_self_followups=3,
            num_heldout=2,
            max_tokens=8,
            generate_batch=8,
            schedule=Schedule(epochs=1, tokens_per_batch=256, warmup_steps=1),
            progress=False,
            save_dtype="float32",
            evaluate=False,
        )
    )
    data = summary["data"]
    assert 1 <= data["followup_conversations"] <= 3
    assert data["train_conversations"] == 8 + data["followup_conversations"]
    answered = Sequences.load(tmp_path / "followup_answers.pt")
    assert len(answered) == data["followup_conversations"]
