"""The prompts of a benchmark: `load_requests(spec, tokenizer)` -> one `BenchRequest` each.

Datasets (chosen by name; an unknown name lists the supported ones):
- random: prompts of random token ids from the tokenizer's vocabulary, lengths drawn uniformly in
  [len * (1 - range_ratio), len * (1 + range_ratio)] (vLLM's convention);
- chat: the built-in multi-turn conversations (chat_conversations), each with the output length of
  its last answer;
- file: ShareGPT JSON or JSONL prompts (dataset_files);
- shared-prefix: groups of prompts that share a long system prompt (SGLang's
  generated-shared-prefix), every group's requests mixed in one shuffled order;
- multiturn: the built-in conversations replayed turn by turn with the server's own answers in
  the history (`ConversationScript`; conversation_runner sends them: each turn depends on the
  answer before it); `load_requests` gives every turn with the built-in answers in its history,
  the lengths the report states before the run.

Every draw comes from one numpy Generator seeded with `spec.seed`, so a seed gives the same
requests on every run. Where a dataset has fewer entries than prompts asked, it is cycled, each
pass in a new shuffled order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.bench_serving.chat_conversations import CONVERSATIONS, Conversation
from cluster.bench_serving.dataset_files import FilePrompt, read_prompt_file

# Re-tokenizing decoded random ids can merge or split tokens at their boundaries; a few rounds of
# trimming or topping up bring the prompt back to the drawn length.
FIT_ROUNDS = 4


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class BenchRequest:
    """One prompt: `prompt` is what /v1/completions gets (a conversation as a transcript),
    `messages` what /v1/chat/completions gets (empty: one user turn holding `prompt`)."""

    prompt: str
    prompt_len: int  # tokens of `prompt` before any chat template or special token
    output_len: int  # max_tokens
    messages: tuple[Message, ...] = ()

    def chat_messages(self) -> list[dict[str, str]]:
        turns = self.messages or (Message("user", self.prompt),)
        return [turn.to_json() for turn in turns]


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    num_prompts: int
    seed: int = 0
    input_len: int = 1024  # random
    output_len: int = 128  # random, and file prompts that give no output length
    range_ratio: float = 0.0  # random
    path: str | None = None  # file
    # shared-prefix: num_prompts is groups * prompts_per_group.
    groups: int = 8
    prompts_per_group: int = 16
    system_len: int = 1500
    question_len: int = 128

    def to_json(self) -> dict[str, Any]:
        shared = self.name == "shared-prefix"
        return {
            "name": self.name,
            "path": self.path,
            "num_prompts": self.num_prompts,  # multiturn: conversations
            "seed": self.seed,
            "input_len": self.input_len if self.name == "random" else None,
            "output_len": self.output_len if self.name not in ("chat", "multiturn") else None,
            "range_ratio": self.range_ratio if self.name == "random" else None,
            "groups": self.groups if shared else None,
            "prompts_per_group": self.prompts_per_group if shared else None,
            "system_len": self.system_len if shared else None,
            "question_len": self.question_len if shared else None,
        }


@dataclass(frozen=True)
class DatasetStats:
    """The lengths a dataset actually drew, for the report."""

    mean_prompt_len: float
    mean_output_len: float
    min_prompt_len: int
    max_prompt_len: int

    @classmethod
    def of(cls, requests: list[BenchRequest]) -> DatasetStats:
        prompt_lens = [request.prompt_len for request in requests]
        return cls(
            mean_prompt_len=round(float(np.mean(prompt_lens)), 2),
            mean_output_len=round(float(np.mean([r.output_len for r in requests])), 2),
            min_prompt_len=min(prompt_lens),
            max_prompt_len=max(prompt_lens),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "mean_prompt_len": self.mean_prompt_len,
            "mean_output_len": self.mean_output_len,
            "min_prompt_len": self.min_prompt_len,
            "max_prompt_len": self.max_prompt_len,
        }


def load_requests(spec: DatasetSpec, tokenizer: Any) -> list[BenchRequest]:
    if spec.num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {spec.num_prompts}")
    builder = DATASETS.get(spec.name)
    if builder is None:
        raise ValueError(f"unknown dataset {spec.name!r}; supported: {', '.join(DATASETS)}")
    return builder(spec, tokenizer, np.random.default_rng(spec.seed))


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive bounds [length * (1 - ratio), length * (1 + ratio)], at least 1 token."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    # Rounded first: 100 * (1 - 0.3) is 70.00000000000001 in floating point.
    low = max(1, math.ceil(round(length * (1 - range_ratio), 6)))
    high = max(low, math.floor(round(length * (1 + range_ratio), 6)))
    return low, high


def random_requests(
    spec: DatasetSpec, tokenizer: Any, rng: np.random.Generator
) -> list[BenchRequest]:
    vocabulary = plain_token_ids(tokenizer)
    input_lens = _draw_lengths(spec.input_len, spec, rng)
    output_lens = _draw_lengths(spec.output_len, spec, rng)
    requests = []
    for input_len, output_len in zip(input_lens, output_lens, strict=True):
        prompt, prompt_len = _random_text(int(input_len), tokenizer, vocabulary, rng)
        requests.append(BenchRequest(prompt, prompt_len, int(output_len)))
    return requests


def plain_token_ids(tokenizer: Any) -> np.ndarray:
    """Ids that decode alone to text which encodes back to that same id: no special or added
    token (a template marker in a random prompt would change what the model sees), no byte
    fragment of a multi-byte character (it decodes to U+FFFD, three bytes of its own)."""
    added = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    candidates = [token for token in range(len(tokenizer)) if token not in added]
    texts = tokenizer.batch_decode([[token] for token in candidates])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    plain = [t for t, ids in zip(candidates, encoded, strict=True) if list(ids) == [t]]
    if not plain:
        raise ValueError("the tokenizer has no token that decodes and encodes back to itself")
    return np.asarray(plain)


def _draw_lengths(length: int, spec: DatasetSpec, rng: np.random.Generator) -> np.ndarray:
    low, high = length_range(length, spec.range_ratio)
    return rng.integers(low, high + 1, size=spec.num_prompts)


def _random_text(
    length: int, tokenizer: Any, vocabulary: np.ndarray, rng: np.random.Generator
) -> tuple[str, int]:
    """Text of random tokens and its length when tokenized: `length`, unless merges at the
    random tokens' boundaries keep moving it (then within a few tokens of it)."""
    ids = rng.choice(vocabulary, size=length).tolist()
    for _ in range(FIT_ROUNDS):
        text = tokenizer.decode(ids)
        actual = tokenizer.encode(text, add_special_tokens=False)
        if len(actual) == length:
            return text, length
        if len(actual) > length:
            ids = actual[:length]
        else:
            ids = actual + rng.choice(vocabulary, size=length - len(actual)).tolist()
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def shared_prefix_requests(
    spec: DatasetSpec, tokenizer: Any, rng: np.random.Generator
) -> list[BenchRequest]:
    """`groups` system prompts of `system_len` random tokens, each followed by
    `prompts_per_group` questions of `question_len` random tokens: for chat, a system and a user
    message; for completions, the system prompt, a blank line and the question. Shuffled, so
    that the groups arrive interleaved, as from many users at once."""
    if spec.num_prompts != spec.groups * spec.prompts_per_group:
        raise ValueError(
            f"shared-prefix sends groups * prompts_per_group = "
            f"{spec.groups * spec.prompts_per_group} prompts, not {spec.num_prompts}"
        )
    vocabulary = plain_token_ids(tokenizer)
    requests = []
    for _ in range(spec.groups):
        system, _ = _random_text(spec.system_len, tokenizer, vocabulary, rng)
        for _ in range(spec.prompts_per_group):
            question, _ = _random_text(spec.question_len, tokenizer, vocabulary, rng)
            prompt = f"{system}\n\n{question}"
            prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
            messages = (Message("system", system), Message("user", question))
            requests.append(BenchRequest(prompt, prompt_len, spec.output_len, messages))
    return [requests[i] for i in rng.permutation(len(requests))]


def chat_requests(
    spec: DatasetSpec, tokenizer: Any, rng: np.random.Generator
) -> list[BenchRequest]:
    built: dict[int, BenchRequest] = {}
    requests = []
    for pick in draw_indices(len(CONVERSATIONS), spec.num_prompts, rng):
        if pick not in built:
            built[pick] = _conversation_request(CONVERSATIONS[pick], tokenizer)
        requests.append(built[pick])
    return requests


def _conversation_request(conversation: Conversation, tokenizer: Any) -> BenchRequest:
    return conversation_request(conversation.turns, conversation.output_len, tokenizer)


def conversation_request(turns: Sequence[str], output_len: int, tokenizer: Any) -> BenchRequest:
    """The request for the answer to `turns` (user, assistant, ..., user)."""
    roles = ("user", "assistant")
    messages = tuple(Message(roles[position % 2], text) for position, text in enumerate(turns))
    prompt = transcript(messages)
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
    return BenchRequest(prompt, prompt_len, output_len, messages)


def transcript(messages: tuple[Message, ...]) -> str:
    """A conversation as plain text for /v1/completions, ending where the assistant answers.
    A text that begins with white space follows its "Role:" as it is: a server's answer to
    the transcript before it begins where "Assistant:" ended (usually with a space), so the
    next turn's prompt holds that answer exactly as the server wrote it after its prompt, and
    a prefix cache finds both."""
    lines = [_line(message) for message in messages]
    return "\n\n".join([*lines, "Assistant:"])


def _line(message: Message) -> str:
    role = message.role.capitalize()
    if message.content[:1].isspace():
        return f"{role}:{message.content}"
    return f"{role}: {message.content}"


@dataclass(frozen=True)
class ConversationScript:
    """A built-in conversation to replay: its user turns, and the built-in answers, whose
    lengths in tokens are the answers' max_tokens (the last turn's: the conversation's
    output_len). A run puts the server's own answers in the history instead of these."""

    topic: str
    user_turns: tuple[str, ...]
    reference_answers: tuple[str, ...]  # one fewer than the user turns
    output_lens: tuple[int, ...]  # one per user turn

    def turn_request(self, turn: int, answers: Sequence[str], tokenizer: Any) -> BenchRequest:
        """The request for user turn `turn`, after the `answers` to the turns before it."""
        if len(answers) != turn:
            raise ValueError(f"turn {turn} follows {turn} answers, got {len(answers)}")
        history = [text for pair in zip(self.user_turns, answers) for text in pair]
        return conversation_request(
            [*history, self.user_turns[turn]], self.output_lens[turn], tokenizer
        )


def multiturn_scripts(
    spec: DatasetSpec, tokenizer: Any, rng: np.random.Generator
) -> list[ConversationScript]:
    """`spec.num_prompts` conversations, drawn as the chat dataset draws them."""
    built: dict[int, ConversationScript] = {}
    scripts = []
    for pick in draw_indices(len(CONVERSATIONS), spec.num_prompts, rng):
        if pick not in built:
            built[pick] = _script(CONVERSATIONS[pick], tokenizer)
        scripts.append(built[pick])
    return scripts


def _script(conversation: Conversation, tokenizer: Any) -> ConversationScript:
    answers = conversation.turns[1::2]
    lens = [max(1, len(tokenizer.encode(a, add_special_tokens=False))) for a in answers]
    return ConversationScript(
        topic=conversation.topic,
        user_turns=conversation.turns[0::2],
        reference_answers=answers,
        output_lens=(*lens, conversation.output_len),
    )


def multiturn_requests(
    spec: DatasetSpec, tokenizer: Any, rng: np.random.Generator
) -> list[BenchRequest]:
    """Every turn of the conversations, with the built-in answers in the history."""
    return [
        script.turn_request(turn, script.reference_answers[:turn], tokenizer)
        for script in multiturn_scripts(spec, tokenizer, rng)
        for turn in range(len(script.user_turns))
    ]


def file_requests(
    spec: DatasetSpec, tokenizer: Any, rng: np.random.Generator
) -> list[BenchRequest]:
    if spec.path is None:
        raise ValueError("the file dataset needs a path (--dataset-path)")
    entries = read_prompt_file(spec.path)
    built: dict[int, BenchRequest] = {}
    requests = []
    for pick in draw_indices(len(entries), spec.num_prompts, rng):
        if pick not in built:
            built[pick] = _file_request(entries[pick], spec.output_len, tokenizer)
        requests.append(built[pick])
    return requests


def _file_request(entry: FilePrompt, default_output_len: int, tokenizer: Any) -> BenchRequest:
    output_len = entry.output_len or default_output_len
    if entry.output_len is None and entry.reference_output is not None:
        reference = tokenizer.encode(entry.reference_output, add_special_tokens=False)
        output_len = max(1, len(reference))
    prompt_len = len(tokenizer.encode(entry.prompt, add_special_tokens=False))
    return BenchRequest(entry.prompt, prompt_len, output_len)


def draw_indices(count: int, num_prompts: int, rng: np.random.Generator) -> list[int]:
    """num_prompts indices into `count` entries: shuffled passes over all of them, so that no
    entry repeats before every other one has been used."""
    passes = -(-num_prompts // count)
    order = np.concatenate([rng.permutation(count) for _ in range(passes)])
    return order[:num_prompts].tolist()


DatasetBuilder = Callable[[DatasetSpec, Any, np.random.Generator], list[BenchRequest]]
DATASETS: dict[str, DatasetBuilder] = {
    "random": random_requests,
    "chat": chat_requests,
    "file": file_requests,
    "shared-prefix": shared_prefix_requests,
    "multiturn": multiturn_requests,
}
