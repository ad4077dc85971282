"""Chat prompts for training the EAGLE draft of SmolLM2-135M-Instruct by self-distillation: the
target answers them and the draft learns to predict those answers, so the prompts only need to
cover the kinds of requests a small chat model gets, with no downloaded data set.

`training_prompts` combines instruction templates with slot fillers, deterministically per seed;
`heldout_prompts` are written by hand, apart from the templates, and share no user message with
the training set, so acceptance measured on them is acceptance on prompts the draft never saw.
The word lists, templates and held-out prompts are data (prompt_data.json, spec.train.prompt_data).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from functools import cache
from itertools import product

from spec.train import prompt_data

Message = dict[str, str]
Conversation = list[Message]

# Topics from science, history, cooking, travel, health, technology, programming, sports, finance,
# nature, everyday life and the arts. Concepts fit "explain X"; activities fit "tips for X".
CONCEPTS = prompt_data.strings("CONCEPTS")
ACTIVITIES = prompt_data.strings("ACTIVITIES")
CHOICES = prompt_data.strings("CHOICES")
PAIRS = prompt_data.pairs("PAIRS")
NAMES = prompt_data.strings("NAMES")
OBJECTS = prompt_data.strings("OBJECTS")
PURPOSES = prompt_data.strings("PURPOSES")
CODE_TASKS = prompt_data.strings("CODE_TASKS")
LANGUAGES = prompt_data.strings("LANGUAGES")
PYTHON_FEATURES = prompt_data.strings("PYTHON_FEATURES")
SENTENCES = prompt_data.strings("SENTENCES")
PARAGRAPHS = prompt_data.strings("PARAGRAPHS")
SCENARIOS = prompt_data.strings("SCENARIOS")
COUNTRIES = prompt_data.strings("COUNTRIES")
WORDS = prompt_data.strings("WORDS")
HOWTO_TASKS = prompt_data.strings("HOWTO_TASKS")

# Templates, grouped by the slots they take.
CONCEPT_TEMPLATES = prompt_data.strings("CONCEPT_TEMPLATES")
AUDIENCES = prompt_data.strings("AUDIENCES")
ACTIVITY_TEMPLATES = prompt_data.strings("ACTIVITY_TEMPLATES")
COMPARE_TEMPLATES = prompt_data.strings("COMPARE_TEMPLATES")
PROS_CONS_TEMPLATES = prompt_data.strings("PROS_CONS_TEMPLATES")
POEM_TEMPLATES = prompt_data.strings("POEM_TEMPLATES")
STORY_TEMPLATES = prompt_data.strings("STORY_TEMPLATES")
LETTER_TEMPLATES = prompt_data.strings("LETTER_TEMPLATES")
MATH_TEMPLATES = prompt_data.strings("MATH_TEMPLATES")
CODE_TEMPLATES = prompt_data.strings("CODE_TEMPLATES")
PYTHON_FEATURE_TEMPLATES = prompt_data.strings("PYTHON_FEATURE_TEMPLATES")
TRANSLATE_TEMPLATES = prompt_data.strings("TRANSLATE_TEMPLATES")
TRANSLATE_LANGUAGES = prompt_data.strings("TRANSLATE_LANGUAGES")
REWRITE_TEMPLATES = prompt_data.strings("REWRITE_TEMPLATES")
REWRITE_STYLES = prompt_data.strings("REWRITE_STYLES")
SUMMARIZE_TEMPLATES = prompt_data.strings("SUMMARIZE_TEMPLATES")
WHAT_IF_TEMPLATES = prompt_data.strings("WHAT_IF_TEMPLATES")
COUNTRY_TEMPLATES = prompt_data.strings("COUNTRY_TEMPLATES")
WORD_TEMPLATES = prompt_data.strings("WORD_TEMPLATES")
HOWTO_TEMPLATES = prompt_data.strings("HOWTO_TEMPLATES")
# A few prompts in other languages: the target answers them too, so the draft should see some.
FOREIGN = prompt_data.templates_and_topics("FOREIGN")

SYSTEM_PROMPTS = prompt_data.strings("SYSTEM_PROMPTS")
OPENERS = prompt_data.pairs("OPENERS")

SYSTEM_FRACTION = 0.2
TWO_TURN_FRACTION = 0.1


def _fill(templates: list[str], slot_values: Iterable[dict]) -> list[str]:
    values = list(slot_values)
    return [template.format(**slots) for template in templates for slots in values]


def _grid(**slots: Iterable) -> list[dict]:
    names = list(slots)
    return [dict(zip(names, combo)) for combo in product(*slots.values())]


def _math_slots() -> list[dict]:
    pairs = product((3, 4, 6, 8, 12), (2, 3, 5, 7))
    return [
        {"name": name, "a": a, "b": b, "total": a + b, "product": a * b, "tens": 10 * a}
        for name, (a, b) in product(NAMES, pairs)
    ]


@cache
def _families() -> tuple[tuple[float, tuple[str, ...]], ...]:
    """(weight, prompts) per family. Weights set the mix of any prefix; combinatorial families
    (stories, letters, math) are large, and without weights they would crowd out the rest."""
    counts = (3, 4, 5, 7)
    families = [
        (14, _fill(CONCEPT_TEMPLATES, _grid(c=CONCEPTS, n=counts, who=AUDIENCES))),
        (10, _fill(ACTIVITY_TEMPLATES, _grid(a=ACTIVITIES, n=counts))),
        (5, _fill(COMPARE_TEMPLATES, [{"x": x, "y": y} for p in PAIRS for x, y in (p, p[::-1])])),
        (3, _fill(PROS_CONS_TEMPLATES, _grid(x=CHOICES))),
        (5, _fill(POEM_TEMPLATES, _grid(t=CONCEPTS + ACTIVITIES))),
        (6, _fill(STORY_TEMPLATES, _grid(name=NAMES, o=OBJECTS))),
        (5, _fill(LETTER_TEMPLATES, _grid(name=NAMES, p=PURPOSES))),
        (8, _fill(MATH_TEMPLATES, _math_slots())),
        (9, _fill(CODE_TEMPLATES, _grid(lang=LANGUAGES, task=CODE_TASKS))),
        (2, _fill(PYTHON_FEATURE_TEMPLATES, _grid(f=PYTHON_FEATURES))),
        (4, _fill(TRANSLATE_TEMPLATES, _grid(lang=TRANSLATE_LANGUAGES, s=SENTENCES))),
        (3, _fill(REWRITE_TEMPLATES, _grid(style=REWRITE_STYLES, s=SENTENCES))),
        (2, _fill(SUMMARIZE_TEMPLATES, _grid(text=PARAGRAPHS))),
        (2, _fill(WHAT_IF_TEMPLATES, _grid(s=SCENARIOS))),
        (3, _fill(COUNTRY_TEMPLATES, _grid(c=COUNTRIES))),
        (2, _fill(WORD_TEMPLATES, _grid(w=WORDS))),
        (5, _fill(HOWTO_TEMPLATES, _grid(t=HOWTO_TASKS))),
        (2, [text for templates, topics in FOREIGN for text in _fill(templates, _grid(t=topics))]),
    ]
    # A prompt two families can both produce counts once, so every conversation is distinct.
    seen: set[str] = set()
    distinct = []
    for weight, prompts in families:
        fresh = tuple(dict.fromkeys(p for p in prompts if p not in seen))
        seen.update(fresh)
        distinct.append((weight, fresh))
    return tuple(distinct)


def max_training_prompts() -> int:
    return sum(len(prompts) for _, prompts in _families())


def training_prompts(n: int, seed: int = 0) -> list[Conversation]:
    """n distinct conversations, each ending with a user message. For a given seed, a smaller n
    gives a prefix of a larger one, so growing the set keeps the examples already trained on."""
    capacity = max_training_prompts()
    if not 0 <= n <= capacity:
        raise ValueError(
            f"training_prompts can make between 0 and {capacity} distinct conversations; "
            f"asked for {n}"
        )
    rng = random.Random(seed)
    # Spread each family evenly through the order at a rate set by its weight, so any prefix
    # has the intended mix until a small family runs out.
    keyed: list[tuple[float, str]] = []
    for weight, prompts in _families():
        shuffled = rng.sample(prompts, len(prompts))
        keyed.extend(((i + rng.random()) / weight, text) for i, text in enumerate(shuffled))
    keyed.sort()
    return [_conversation(text, rng) for _, text in keyed[:n]]


def _conversation(prompt: str, rng: random.Random) -> Conversation:
    messages: Conversation = []
    if rng.random() < SYSTEM_FRACTION:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if rng.random() < TWO_TURN_FRACTION:
        opener, reply = rng.choice(OPENERS)
        messages += [{"role": "user", "content": opener}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": prompt})
    return messages


# Held-out prompts: own wording and mostly own topics, none of them a template instance.
HELDOUT_SINGLE = prompt_data.strings("HELDOUT_SINGLE")
HELDOUT_SYSTEM = prompt_data.pairs("HELDOUT_SYSTEM")
HELDOUT_MULTI_TURN = prompt_data.triples("HELDOUT_MULTI_TURN")
HELDOUT_FOREIGN = prompt_data.system_and_user("HELDOUT_FOREIGN")
# Held-out user messages that ask for or about code: their kind is "code" whatever their form.
HELDOUT_CODE = set(prompt_data.strings("HELDOUT_CODE"))
HELDOUT_KINDS = ("single turn", "system prompt", "other language", "multi-turn", "code")


def heldout_kinds() -> list[str]:
    """The kind of each of `heldout_prompts()`, in its order: "code" for a conversation about
    code, else "other language" (not English), "multi-turn", "system prompt" or "single turn"."""
    kinds = ["single turn"] * len(HELDOUT_SINGLE)
    kinds += ["system prompt"] * len(HELDOUT_SYSTEM) + ["other language"] * len(HELDOUT_FOREIGN)
    kinds += ["multi-turn"] * len(HELDOUT_MULTI_TURN)
    users = [
        [m["content"] for m in conversation if m["role"] == "user"]
        for conversation in heldout_prompts()
    ]
    return [
        "code" if any(text in HELDOUT_CODE for text in texts) else kind
        for kind, texts in zip(kinds, users, strict=True)
    ]


def heldout_prompts() -> list[Conversation]:
    conversations = [[{"role": "user", "content": text}] for text in HELDOUT_SINGLE]
    for system, text in HELDOUT_SYSTEM + HELDOUT_FOREIGN:
        head = [] if system is None else [{"role": "system", "content": system}]
        conversations.append(head + [{"role": "user", "content": text}])
    for first, reply, second in HELDOUT_MULTI_TURN:
        conversations.append(
            [
                {"role": "user", "content": first},
                {"role": "assistant", "content": reply},
                {"role": "user", "content": second},
            ]
        )
    return conversations
