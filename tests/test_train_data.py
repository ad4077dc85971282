"""`pdcluster train-draft`'s data (spec/train/data.py, spec/train/self_prompts.py): answer files
hold the engine's greedy answers, grow and resume where they stopped, and know their model by
content; self-written prompts come from the model's user turn and resume in order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from spec.train.data import Sequences, target_answers
from spec.train.self_prompts import OPENINGS, self_written_prompts, user_turn

# One CPU thread, and the predictable target: conftest.py.
pytestmark = pytest.mark.usefixtures("one_thread")


class Interrupted(Exception):
    """A generation killed midway."""


class CountingLLM:
    """Passes chat calls to the engine, recording the conversations asked for; raises instead
    once `fail_after` calls were made (a generation killed midway)."""

    def __init__(self, llm: LLM, fail_after: int | None = None) -> None:
        self.llm = llm
        self.model_path = llm.model_path
        self.asked: list = []
        self.fail_after = fail_after

    def chat(self, conversations, params):
        if self.fail_after is not None and len(self.asked) >= self.fail_after:
            raise Interrupted
        self.asked.append(list(conversations))
        return self.llm.chat(conversations, params)


@pytest.fixture(scope="module")
def answer_llm(predictable_path: Path) -> LLM:
    return LLM(str(predictable_path), device="cpu", max_num_seqs=8, kv_cache_tokens=2048)


CONVERSATIONS = [[{"role": "user", "content": f"question {i}: {'ab' * i}"}] for i in range(7)]


def test_answers_are_the_engines_greedy_outputs(answer_llm: LLM, tmp_path: Path) -> None:
    data = target_answers(answer_llm, CONVERSATIONS[:3], tmp_path / "a.pt", 8, progress=False)
    params = SamplingParams(max_tokens=8, temperature=0)
    for i, conversation in enumerate(CONVERSATIONS[:3]):
        prompt = answer_llm.apply_chat_template(conversation)
        (out,) = answer_llm.chat([conversation], params)
        assert data.prompt_lens[i] == len(prompt)
        assert data.tokens[i] == prompt + list(out.token_ids)
    assert data.num_answer_tokens == sum(len(t) - n for t, n in zip(data.tokens, data.prompt_lens))


def test_answers_file_is_extended_not_regenerated(answer_llm: LLM, tmp_path: Path) -> None:
    path = tmp_path / "answers.pt"
    first = CountingLLM(answer_llm, fail_after=1)
    with pytest.raises(Interrupted):  # killed after the first chunk was saved
        target_answers(first, CONVERSATIONS[:5], path, 8, chunk=2, progress=False, save_every_s=0)
    saved = Sequences.load(path)
    assert len(saved) == 2 and first.asked == [CONVERSATIONS[:2]]

    again = CountingLLM(answer_llm)
    data = target_answers(again, CONVERSATIONS[:5], path, 8, chunk=2, progress=False)
    assert again.asked == [CONVERSATIONS[2:4], CONVERSATIONS[4:5]]
    assert data.tokens[:2] == saved.tokens and data.prompt_lens[:2] == saved.prompt_lens

    more = CountingLLM(answer_llm)
    grown = target_answers(more, CONVERSATIONS, path, 8, chunk=2, progress=False)
    assert more.asked == [CONVERSATIONS[5:7]]
    assert grown.tokens[:5] == data.tokens and len(grown) == len(CONVERSATIONS)
    reloaded = Sequences.load(path)
    assert reloaded.tokens == grown.tokens and reloaded.prompt_lens == grown.prompt_lens
    assert reloaded.meta["num_conversations"] == len(CONVERSATIONS)

    refused = CountingLLM(answer_llm)
    with pytest.raises(ValueError, match="max_tokens"):
        target_answers(refused, CONVERSATIONS, path, 9, progress=False)
    with pytest.raises(ValueError, match="num_conversations"):
        target_answers(refused, CONVERSATIONS[:3], path, 8, progress=False)
    with pytest.raises(ValueError, match="first"):
        target_answers(refused, CONVERSATIONS[1:], path, 8, progress=False)
    assert refused.asked == []
    assert Sequences.load(path).tokens == grown.tokens


def test_answers_file_is_rewritten_at_most_once_a_period_and_at_the_end(
    answer_llm: LLM, tmp_path: Path
) -> None:
    path = tmp_path / "answers.pt"
    interrupted = CountingLLM(answer_llm, fail_after=2)
    with pytest.raises(Interrupted):  # two chunks answered, within one period: nothing saved
        target_answers(interrupted, CONVERSATIONS[:5], path, 8, chunk=2, progress=False)
    assert not path.exists()

    whole = CountingLLM(answer_llm)
    data = target_answers(whole, CONVERSATIONS[:5], path, 8, chunk=2, progress=False)
    assert len(whole.asked) == 3
    assert Sequences.load(path).tokens == data.tokens and len(data) == 5


def _changed_copies(model: Path, where: Path) -> dict[str, Path]:
    """The model folder copied as is, and twice changed: in its config, and in one weight byte."""
    copies = {name: where / name for name in ("moved", "other-config", "other-weights")}
    for copy in copies.values():
        shutil.copytree(model, copy)
    config = json.loads((copies["other-config"] / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (copies["other-config"] / "config.json").write_text(json.dumps(config))
    weights = copies["other-weights"] / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    return copies


def test_generated_files_know_their_model_by_content_not_by_folder(
    answer_llm: LLM, predictable_path: Path, tmp_path: Path
) -> None:
    answers, messages = tmp_path / "answers.pt", tmp_path / "messages.json"
    data = target_answers(answer_llm, CONVERSATIONS[:2], answers, 8, progress=False)
    written = self_written_prompts(answer_llm, 3, messages, max_tokens=16, progress=False)
    copies = _changed_copies(predictable_path, tmp_path)

    # The same model in another folder (moved, or its GGUF converted again) goes on.
    moved = CountingLLM(answer_llm)
    moved.model_path = copies["moved"]
    grown = target_answers(moved, CONVERSATIONS[:3], answers, 8, progress=False)
    assert moved.asked == [CONVERSATIONS[2:3]] and grown.tokens[:2] == data.tokens
    moved_writer = GeneratingLLM(answer_llm)
    moved_writer.model_path = copies["moved"]
    assert self_written_prompts(moved_writer, 3, messages, max_tokens=16, progress=False) == (
        written
    )
    assert moved_writer.calls == []

    for name in ("other-config", "other-weights"):
        other = CountingLLM(answer_llm)
        other.model_path = copies[name]
        with pytest.raises(ValueError, match=r"\(model\)"):
            target_answers(other, CONVERSATIONS[:3], answers, 8, progress=False)
        other_writer = GeneratingLLM(answer_llm)
        other_writer.model_path = copies[name]
        with pytest.raises(ValueError, match=r"\(model\)"):
            self_written_prompts(other_writer, 3, messages, max_tokens=16, progress=False)


def test_generated_files_from_before_fingerprints_are_matched_by_folder(
    answer_llm: LLM, predictable_path: Path, tmp_path: Path
) -> None:
    path = tmp_path / "answers.pt"
    target_answers(answer_llm, CONVERSATIONS[:2], path, 8, progress=False)
    old = Sequences.load(path)
    del old.meta["model_fingerprint"]
    old.save(path)

    same_folder = CountingLLM(answer_llm)
    assert len(target_answers(same_folder, CONVERSATIONS[:3], path, 8, progress=False)) == 3
    assert "model_fingerprint" in Sequences.load(path).meta  # upgraded when saved
    old.save(path)
    moved = CountingLLM(answer_llm)
    moved.model_path = _changed_copies(predictable_path, tmp_path)["moved"]
    with pytest.raises(ValueError, match=r"\(model\)"):
        target_answers(moved, CONVERSATIONS[:3], path, 8, progress=False)


class GeneratingLLM:
    """Passes generate calls to the engine, recording their sizes; raises instead once
    `fail_after` calls were made."""

    def __init__(self, llm: LLM, fail_after: int | None = None) -> None:
        self.llm = llm
        self.model_path = llm.model_path
        self.tokenizer = llm.tokenizer
        self.calls: list[int] = []
        self.fail_after = fail_after

    def generate(self, prompts, params):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise Interrupted
        self.calls.append(len(prompts))
        return self.llm.generate(prompts, params)


def test_self_written_prompts_come_from_the_models_user_turn(
    answer_llm: LLM, tmp_path: Path
) -> None:
    turn = user_turn(answer_llm.tokenizer)
    assert turn.prefix == "<|user|>"  # tests/tiny_models.py CHAT_TEMPLATE
    conversations = self_written_prompts(
        answer_llm, 10, tmp_path / "p.json", seed=3, max_tokens=16, chunk=4, progress=False
    )
    messages = [c[0]["content"] for c in conversations]
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in conversations)
    assert len(messages) == 10 and len({" ".join(m.lower().split()) for m in messages}) == 10
    assert all(len(m) >= 8 and m == m.strip() and turn.end not in m for m in messages)
    # Sampled, not greedy: the same prompt set continued two ways would repeat itself.
    openings = {m.split()[0] for m in messages}
    assert len(openings) > 1 and any(m.startswith(o) for o in OPENINGS if o for m in messages)


def test_self_written_prompts_resume_and_grow_in_order(answer_llm: LLM, tmp_path: Path) -> None:
    whole = self_written_prompts(
        answer_llm, 9, tmp_path / "whole.json", max_tokens=16, chunk=4, progress=False
    )
    path = tmp_path / "p.json"
    killed = GeneratingLLM(answer_llm, fail_after=1)
    with pytest.raises(Interrupted):
        self_written_prompts(killed, 9, path, max_tokens=16, chunk=4, progress=False)
    assert json.loads(path.read_text())["tried"] == 4

    again = GeneratingLLM(answer_llm)
    resumed = self_written_prompts(again, 9, path, max_tokens=16, chunk=4, progress=False)
    assert resumed == whole
    shorter = self_written_prompts(again, 5, path, max_tokens=16, chunk=4, progress=False)
    assert shorter == whole[:5]
    calls = len(again.calls)
    # Other batching, the same set: every candidate has its own seed.
    rebatched = self_written_prompts(
        answer_llm, 9, tmp_path / "other.json", max_tokens=16, chunk=3, progress=False
    )
    assert rebatched == whole
    with pytest.raises(ValueError, match="max_tokens"):
        self_written_prompts(again, 9, path, max_tokens=17, chunk=4, progress=False)
    assert len(again.calls) == calls


def test_self_written_prompts_give_up_on_a_model_that_writes_nothing(
    answer_llm: LLM, tmp_path: Path
) -> None:
    class Silent(GeneratingLLM):
        def generate(self, prompts, params):
            self.calls.append(len(prompts))
            return [SimpleNamespace(text="") for _ in prompts]

    silent = Silent(answer_llm)
    with pytest.raises(RuntimeError, match="0 distinct user messages in"):
        self_written_prompts(silent, 2, tmp_path / "p.json", chunk=4, progress=False)
    assert sum(silent.calls) == 20 * 2 + 10 * 4
