"""Chat prompts for training the EAGLE draft of SmolLM2-135M-Instruct by self-distillation: the
target answers them and the draft learns to predict those answers, so the prompts only need to
cover the kinds of requests a small chat model gets, with no downloaded data set.

`training_prompts` combines instruction templates with slot fillers, deterministically per seed;
`heldout_prompts` are written by hand, apart from the templates, and share no user message with
the training set, so acceptance measured on them is acceptance on prompts the draft never saw.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from functools import cache
from itertools import product

Message = dict[str, str]
Conversation = list[Message]

# Topics from science, history, cooking, travel, health, technology, programming, sports, finance,
# nature, everyday life and the arts. Concepts fit "explain X"; activities fit "tips for X".
CONCEPTS = [
    "photosynthesis",
    "black holes",
    "the water cycle",
    "DNA",
    "plate tectonics",
    "the greenhouse effect",
    "vaccines",
    "natural selection",
    "the French Revolution",
    "the Roman Empire",
    "the Industrial Revolution",
    "the printing press",
    "the Cold War",
    "ancient Egypt",
    "the Renaissance",
    "the Moon landing",
    "fermentation",
    "the Maillard reaction",
    "umami",
    "emulsions",
    "caramelization",
    "gluten",
    "food safety temperatures",
    "sourdough starters",
    "jet lag",
    "travel insurance",
    "visa applications",
    "hostels",
    "airline loyalty programs",
    "the Schengen Area",
    "overtourism",
    "time zones",
    "sleep cycles",
    "intermittent fasting",
    "blood pressure",
    "the immune system",
    "hydration",
    "stress hormones",
    "cholesterol",
    "mindfulness",
    "cloud computing",
    "5G networks",
    "blockchain",
    "machine learning",
    "GPS",
    "solid-state drives",
    "public-key encryption",
    "large language models",
    "recursion",
    "Big-O notation",
    "garbage collection",
    "REST APIs",
    "version control",
    "unit testing",
    "hash tables",
    "async/await",
    "the offside rule in soccer",
    "VO2 max",
    "the Tour de France",
    "the Olympic Games",
    "tennis scoring",
    "cricket",
    "the pick-and-roll in basketball",
    "marathon pacing",
    "compound interest",
    "inflation",
    "index funds",
    "credit scores",
    "diversification",
    "bonds",
    "emergency funds",
    "the 50/30/20 budgeting rule",
    "bird migration",
    "coral reefs",
    "pollination",
    "rainforests",
    "tides",
    "volcanoes",
    "hibernation",
    "fungal networks in forests",
    "time management",
    "recycling",
    "minimalism",
    "small talk",
    "procrastination",
    "habit formation",
    "tipping customs",
    "decluttering",
    "impressionism",
    "the golden ratio in art",
    "jazz improvisation",
    "perspective drawing",
    "film noir",
    "Shakespeare's sonnets",
    "color theory",
    "the Baroque period",
]
ACTIVITIES = [
    "growing crystals at home",
    "stargazing",
    "doing a science fair project",
    "using a microscope",
    "researching family history",
    "reading primary sources",
    "learning about local history",
    "baking bread",
    "making fresh pasta",
    "cooking rice",
    "meal prepping",
    "grilling vegetables",
    "sharpening kitchen knives",
    "packing light",
    "traveling on a budget",
    "planning a road trip",
    "traveling solo",
    "building a running habit",
    "sleeping better",
    "drinking more water",
    "reducing screen time",
    "stretching after work",
    "backing up a laptop",
    "setting up a home Wi-Fi network",
    "using a password manager",
    "building a PC",
    "protecting your privacy online",
    "learning Python",
    "writing clean code",
    "debugging a program",
    "reviewing pull requests",
    "learning SQL",
    "contributing to open source",
    "training for a 10K",
    "learning to swim",
    "starting rock climbing",
    "improving at chess",
    "playing doubles tennis",
    "saving for retirement",
    "paying off debt",
    "making a monthly budget",
    "negotiating a salary",
    "starting to invest",
    "birdwatching",
    "starting a vegetable garden",
    "composting",
    "hiking safely",
    "caring for houseplants",
    "keeping a tidy home",
    "waking up earlier",
    "making friends as an adult",
    "hosting a dinner party",
    "learning a new language",
    "public speaking",
    "moving to a new city",
    "learning to draw",
    "playing the guitar",
    "writing poetry",
    "taking photos with a phone",
    "painting with watercolors",
]
CHOICES = [
    "remote work",
    "electric cars",
    "renting instead of buying a home",
    "owning a dog",
    "living in a big city",
    "nuclear power",
    "standing desks",
    "e-books",
    "solar panels",
    "a four-day work week",
    "buying a used car",
    "studying abroad",
    "open-plan offices",
    "a vegetarian diet",
    "smart home devices",
    "freelancing",
    "credit cards",
    "self-driving cars",
    "online degrees",
    "tiny houses",
    "microservices",
    "static typing",
    "cashless payments",
    "working at a startup",
]
PAIRS = [
    ("Python", "JavaScript"),
    ("TCP", "UDP"),
    ("viruses", "bacteria"),
    ("weather", "climate"),
    ("baking soda", "baking powder"),
    ("stocks", "bonds"),
    ("mitosis", "meiosis"),
    ("RAM", "disk storage"),
    ("SQL databases", "NoSQL databases"),
    ("lists", "tuples in Python"),
    ("crocodiles", "alligators"),
    ("tea", "coffee"),
    ("running", "cycling"),
    ("oil paint", "acrylic paint"),
    ("Greek mythology", "Norse mythology"),
    ("hurricanes", "tornadoes"),
    ("butter", "olive oil"),
    ("debit cards", "credit cards"),
    ("git merge", "git rebase"),
    ("classical music", "jazz"),
    ("yoga", "pilates"),
    ("nuclear fission", "nuclear fusion"),
    ("a monarchy", "a republic"),
    ("frogs", "toads"),
    ("HTTP", "HTTPS"),
    ("trains", "planes for travel within Europe"),
    ("sprinting", "jogging"),
    ("renting a car", "public transport on vacation"),
    ("a Roth IRA", "a traditional IRA"),
    ("watercolor", "gouache"),
]
NAMES = [
    "Alice",
    "Bilal",
    "Chen",
    "Daniela",
    "Emeka",
    "Fatima",
    "George",
    "Hana",
    "Ivan",
    "Julia",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Oscar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tomoko",
    "Uma",
    "Victor",
    "Wen",
    "Ximena",
    "Yusuf",
    "Zoe",
    "Amara",
    "Lucas",
    "Mei",
    "Omar",
    "Sofia",
    "Rahul",
    "Ingrid",
    "Kwame",
    "Elena",
    "Hiroshi",
    "Leila",
    "Pablo",
    "Anya",
    "Tariq",
]
OBJECTS = [
    "an old map",
    "a broken compass",
    "a talking parrot",
    "a locked diary",
    "a lost key",
    "a mysterious letter",
    "a glowing stone",
    "a tiny dragon",
    "a red umbrella",
    "a pocket watch",
    "a paper boat",
    "a forgotten violin",
    "a secret door",
    "a stray kitten",
    "a magic paintbrush",
    "a message in a bottle",
    "an ancient coin",
    "a wooden robot",
    "a jar of fireflies",
    "a time machine",
    "a seed that grows overnight",
    "a stolen painting",
    "a wishing well",
    "an empty suitcase",
    "a singing teapot",
    "a treasure chest",
    "a hot-air balloon",
    "a snow globe",
    "a lucky sock",
    "a friendly ghost",
]
PURPOSES = [
    "asking to move our meeting to Thursday",
    "thanking them for a birthday gift",
    "declining a job offer",
    "inviting them to a picnic on Saturday",
    "apologizing for missing their call",
    "asking for feedback on a report",
    "congratulating them on a new job",
    "following up on an unpaid invoice",
    "requesting a day off next Friday",
    "welcoming them to the team",
    "asking for a recommendation letter",
    "reminding them about the book club",
    "asking to borrow a ladder",
    "sharing notes from today's lecture",
    "introducing them to a colleague",
    "asking about a package that never arrived",
    "proposing a weekly study group",
    "thanking them for hosting us",
    "asking them to review my code",
    "announcing that I'm moving abroad",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a text file",
    "merges two sorted lists",
    "finds the most common element in a list",
    "converts Celsius to Fahrenheit",
    "validates an email address",
    "removes duplicates from a list while keeping order",
    "returns the nth Fibonacci number",
    "flattens a nested list",
    "checks whether a string is a palindrome",
    "prints the average of a column in a CSV file",
    "returns the second largest number in a list",
    "groups words by their first letter",
    "implements binary search",
    "parses a date like 2024-03-15",
    "counts the vowels in a string",
    "generates a random password",
    "sorts a list of records by a given key",
    "finds all anagrams of a word in a list",
    "rotates a square matrix by 90 degrees",
    "computes a factorial",
    "checks whether parentheses are balanced",
    "converts a Roman numeral to an integer",
    "finds the longest word in a sentence",
    "splits a list into chunks of size n",
    "computes a moving average",
    "capitalizes every word in a sentence",
]
LANGUAGES = ["Python", "JavaScript", "Go", "Rust", "Java", "C++"]
PYTHON_FEATURES = [
    "the yield keyword",
    "a decorator",
    "a list comprehension",
    "the with statement",
    "*args and **kwargs",
    "an f-string",
    "a dataclass",
    "enumerate",
    "a lambda",
    "functools.cache",
]
SENTENCES = [
    "The meeting has been moved to next Tuesday.",
    "Could you send me the report by Friday?",
    "I forgot my umbrella at the restaurant.",
    "We're going to the beach this weekend.",
    "The train was delayed by forty minutes.",
    "Thanks a lot for helping me move.",
    "The library closes at eight tonight.",
    "My cat refuses to eat anything but fish.",
    "Please turn off the lights when you leave.",
    "I think we should try the new cafe downtown.",
    "The package should arrive within three days.",
    "Sorry, I can't make it to the party.",
    "It's going to rain all afternoon.",
    "She has been learning the piano for two years.",
    "Where is the nearest pharmacy?",
    "The software update fixed the bug.",
]
PARAGRAPHS = [
    "Honeybees communicate the location of flowers through a waggle dance. The angle of the "
    "dance shows the direction relative to the sun, and its length shows the distance.",
    "The city council voted to turn the old rail yard into a public park. Construction starts "
    "in spring, and the park will include playgrounds, a community garden and bike paths.",
    "Regular breaks improve focus. Studies suggest that working in blocks of about fifty "
    "minutes, followed by a short walk, helps people stay productive through the afternoon.",
    "Our quarterly sales rose by twelve percent, mostly thanks to online orders. Store sales "
    "were flat, and the team plans to invest more in delivery next quarter.",
    "The Great Barrier Reef is the largest coral reef system in the world. Warmer oceans have "
    "caused repeated bleaching events, and scientists are testing ways to help corals recover.",
    "Version 2.0 of the app adds a dark mode, offline sync and faster search. Users on older "
    "phones may need to free up storage before updating.",
]
SCENARIOS = [
    "the Moon disappeared",
    "humans could photosynthesize",
    "the internet went down for a week",
    "everyone spoke the same language",
    "bees went extinct",
    "cars were banned in city centers",
    "the Earth spun twice as fast",
    "money didn't exist",
    "people only needed four hours of sleep",
    "a day had 30 hours",
    "electricity had never been discovered",
    "all glaciers melted",
    "gravity were half as strong",
    "everyone worked from home",
    "dinosaurs had not gone extinct",
    "the printing press had never been invented",
    "we could read each other's thoughts",
    "it never rained again",
    "everyone lived to 150",
    "schools had no homework",
]
COUNTRIES = [
    "Japan",
    "Brazil",
    "Kenya",
    "Canada",
    "Norway",
    "Egypt",
    "India",
    "Mexico",
    "Australia",
    "Germany",
    "Peru",
    "Vietnam",
    "Morocco",
    "Iceland",
    "Argentina",
    "Thailand",
    "Portugal",
    "New Zealand",
    "Ghana",
    "South Korea",
    "Chile",
    "Turkey",
    "Poland",
    "Indonesia",
    "Ireland",
    "Nepal",
    "Finland",
    "Colombia",
    "Greece",
    "the Philippines",
]
WORDS = [
    "serendipity",
    "ephemeral",
    "ubiquitous",
    "pragmatic",
    "resilient",
    "meticulous",
    "ambiguous",
    "benevolent",
    "candid",
    "diligent",
    "eloquent",
    "frugal",
    "gregarious",
    "hypothesis",
    "inevitable",
    "jargon",
    "lethargic",
    "mundane",
    "nostalgia",
    "obsolete",
    "paradox",
    "redundant",
    "skeptical",
    "tenacious",
    "unanimous",
    "vivid",
    "whimsical",
    "zealous",
    "empathy",
    "irony",
]
HOWTO_TASKS = [
    "remove a coffee stain from a shirt",
    "change a flat bike tire",
    "unclog a kitchen sink",
    "boil the perfect egg",
    "write a good cover letter",
    "fold a fitted sheet",
    "clean a cast-iron pan",
    "set up a fish tank",
    "make cold brew coffee",
    "iron a dress shirt",
    "hang a picture frame straight",
    "plan a weekly menu",
    "fix a squeaky door",
    "prepare for a job interview",
    "descale a kettle",
    "pack a suitcase efficiently",
    "start a conversation with a stranger",
    "tie a tie",
    "plant tulip bulbs",
    "speed up a slow laptop",
    "create a strong password",
    "read a nutrition label",
    "apologize sincerely",
    "jump-start a car",
    "organize a small closet",
]

# Templates, grouped by the slots they take.
CONCEPT_TEMPLATES = [
    "Explain {c} in simple terms.",
    "Explain {c} to {who}.",
    "Explain {c} in {n} sentences.",
    "Give me a short overview of {c}.",
    "What are the key ideas behind {c}?",
    "What do people often get wrong about {c}?",
    "Why should I care about {c}?",
    "Give me an analogy that explains {c}.",
    "Summarize the main facts about {c} in bullet points.",
    "Give a real-world example that shows {c} at work.",
    "Describe {c} in one paragraph.",
    "What should I learn after {c}?",
    "Give me {n} interesting facts about {c}.",
    "Write {n} quiz questions about {c}, with answers.",
    "What would {who} find surprising about {c}?",
]
AUDIENCES = [
    "a ten-year-old",
    "a high-school student",
    "my grandmother",
    "a busy manager",
    "someone who has never heard of it",
]
ACTIVITY_TEMPLATES = [
    "How do I get started with {a}?",
    "Make a simple one-week beginner plan for {a}.",
    "What are the benefits of {a}?",
    "I keep giving up on {a}. Any advice?",
    "What's a realistic goal for my first month of {a}?",
    "Give step-by-step guidance on {a}.",
    "List {n} tips for {a}.",
    "What are {n} common mistakes people make when {a}?",
    "What are {n} things every beginner should know about {a}?",
]
COMPARE_TEMPLATES = [
    "Compare {x} and {y}.",
    "What is the difference between {x} and {y}?",
    "Should I pick {x} or {y}? Explain your reasoning.",
    "Make a table comparing {x} and {y}.",
    "How are {x} and {y} similar, and how are they different?",
]
PROS_CONS_TEMPLATES = [
    "What are the pros and cons of {x}?",
    "Is {x} worth it? Give me both sides.",
    "Make a pros and cons list for {x}.",
    "Argue for and against {x} in two short paragraphs.",
]
POEM_TEMPLATES = [
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Write a limerick about {t}.",
    "Write a four-line rhyme about {t}.",
    "Write a funny tweet about {t}.",
]
STORY_TEMPLATES = [
    "Write a short story about {name}, who finds {o}.",
    "Tell a bedtime story about {name} and {o}.",
    "Write a 100-word story in which {name} loses {o}.",
    "Write the opening paragraph of a mystery involving {name} and {o}.",
    "Write a short fable about {name} and {o}, with a moral at the end.",
]
LETTER_TEMPLATES = [
    "Write a short email to {name} {p}.",
    "Write a polite letter to {name} {p}.",
    "Draft a quick text message to {name} {p}.",
    "Write a formal email to {name} {p}.",
]
MATH_TEMPLATES = [
    "{name} has {a} apples and buys {b} more. How many apples does {name} have now?",
    "{name} drives at {tens} km/h for {b} hours. How far does {name} travel?",
    "{name} reads {a} pages a day. How many pages does {name} read in {b} weeks?",
    "A cake needs {b} eggs. How many eggs does {name} need to bake {a} cakes?",
    "{name} saves ${a} every week. How much has {name} saved after {b} weeks?",
    "{name} is painting a wall {a} m long and {b} m high. How many square meters need paint?",
    "{name} buys {a} notebooks at ${b} each and pays with $100. How much change is there?",
    "{name}'s class has {total} students and {b} are absent. How many students are present?",
    "{name} runs {a} km each weekday and {b} km on Saturday. How far is that in a week?",
    "A pizza is cut into {total} slices and {name} eats {b}. What fraction is left?",
    "{name} plants {a} rows of tulips with {b} in each row. How many tulips are there?",
    "{name} shares {product} stickers equally among {b} friends. How many does each get?",
    "{name} walks {a} km in {b} hours. What is the average speed?",
    "A jacket costs ${tens} and is {b}0% off. How much does {name} pay?",
    "{name} has {total} cookies, gives {b} away and bakes {a} more. How many are there now?",
]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "How would you write a {lang} program that {task}?",
    "Show me {lang} code that {task}, with comments.",
]
PYTHON_FEATURE_TEMPLATES = ["In Python, what does {f} do?", "Show me an example of {f} in Python."]
TRANSLATE_TEMPLATES = [
    "Translate into {lang}: {s}",
    'How do you say "{s}" in {lang}?',
    "What is the {lang} translation of this sentence? {s}",
]
TRANSLATE_LANGUAGES = ["French", "Spanish", "German", "Chinese", "Italian", "Japanese"]
REWRITE_TEMPLATES = ['Rewrite this sentence {style}: "{s}"', "Please rephrase {style}: {s}"]
REWRITE_STYLES = ["more formally", "more casually", "for a child", "more concisely", "politely"]
SUMMARIZE_TEMPLATES = [
    "Summarize this paragraph in one sentence:\n\n{text}",
    "Give me three bullet points that capture this text:\n\n{text}",
    "What is the main idea of the following passage?\n\n{text}",
    "Suggest a title for this paragraph:\n\n{text}",
    "Explain this passage to a child:\n\n{text}",
]
WHAT_IF_TEMPLATES = [
    "What would happen if {s}?",
    "Imagine {s}. How would daily life change?",
    "Write a short news report from a world where {s}.",
]
COUNTRY_TEMPLATES = [
    "What is the capital of {c}?",
    "What languages are spoken in {c}?",
    "What currency does {c} use?",
    "Give me three quick facts about {c}.",
    "What is {c} famous for?",
]
WORD_TEMPLATES = [
    'Define the word "{w}".',
    'What does "{w}" mean? Use it in a sentence.',
    'Give me a synonym and an antonym for "{w}".',
]
HOWTO_TEMPLATES = [
    "How do I {t}?",
    "What's the easiest way to {t}?",
    "Give me step-by-step instructions to {t}.",
    "I need to {t}. Where do I start?",
]
# A few prompts in other languages: the target answers them too, so the draft should see some.
FOREIGN = [
    (
        ["Explique-moi simplement {t}.", "Que faut-il savoir sur {t} ?", "Écris un poème sur {t}."],
        [
            "la photosynthèse",
            "le recyclage",
            "la Révolution française",
            "le jardinage",
            "l'inflation",
            "la cuisine italienne",
            "le sommeil",
            "les volcans",
        ],
    ),
    (
        [
            "Explícame {t} de forma sencilla.",
            "¿Qué debo saber sobre {t}?",
            "Escribe un poema corto sobre {t}.",
        ],
        [
            "la fotosíntesis",
            "el reciclaje",
            "la inflación",
            "los volcanes",
            "el sueño",
            "la energía solar",
            "la historia de México",
            "el fútbol",
        ],
    ),
    (
        [
            "Erkläre mir {t} in einfachen Worten.",
            "Was sollte ich über {t} wissen?",
            "Schreib ein kurzes Gedicht über {t}.",
        ],
        [
            "die Photosynthese",
            "das Recycling",
            "die Inflation",
            "den Klimawandel",
            "die Energiewende",
            "den Schlaf",
            "das Bauhaus",
            "die Relativitätstheorie",
        ],
    ),
    (
        ["请用简单的话解释{t}。", "关于{t}，我应该知道些什么？", "写一首关于{t}的短诗。"],
        ["光合作用", "通货膨胀", "回收利用", "火山", "睡眠", "太阳能", "唐朝", "人工智能"],
    ),
]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Keep your answers short.",
    "You are a friendly tutor who explains things step by step.",
    "You are an expert software engineer. Answer precisely.",
    "You are a cheerful assistant who avoids jargon.",
    "Answer in a warm, encouraging tone.",
]
OPENERS = [
    ("Hi there!", "Hello! How can I help you today?"),
    ("Can I ask you something?", "Of course, ask away."),
    ("I need some help.", "Sure, I'm happy to help. What do you need?"),
    ("Good morning!", "Good morning! What can I do for you?"),
    ("Hey, quick question.", "Sure, go ahead."),
]
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
HELDOUT_SINGLE = [
    "Why do cats purr, and do they only do it when they're happy?",
    "Explain how a bicycle stays upright when it's moving.",
    "What's the story behind the Rosetta Stone?",
    "Suggest a three-course vegetarian dinner menu for six guests.",
    "How does a refrigerator keep food cold?",
    "Write three haiku about a lighthouse keeper's night.",
    "My tomato plants have yellow leaves at the bottom. What could be wrong?",
    "Write a Python class that implements a simple LRU cache.",
    "What's the difference between a comet, an asteroid and a meteor?",
    "A bakery sells muffins for $2.50 each or $12 for a box of six. How much do I save on 18?",
    "Draft a short speech for my grandmother's 90th birthday party.",
    "How did medieval castles get fresh water during a siege?",
    "Give me a beginner's guide to beekeeping.",
    "Explain what a SQL JOIN is using an example with customers and orders.",
    "Tell me a short story about a robot who learns to paint.",
    "What should I look for when buying a second-hand bicycle?",
    "Why is the sky blue during the day but red at sunset?",
    "Summarize the plot of Romeo and Juliet in five sentences.",
    "How can I politely tell my neighbor that their dog barks all night?",
    "What's a good first origami model for someone who has never folded paper?",
    "Write a regular expression that matches US phone numbers, and explain each part.",
    "If I walk 8,000 steps a day, roughly how many kilometers is that per month?",
    "Create a packing checklist for a three-day camping trip in the mountains.",
    "What caused the collapse of the Bronze Age civilizations around 1200 BC?",
    "Give me five creative names for a bakery that specializes in pies.",
    "What does a 30% chance of rain actually mean in a weather forecast?",
    "How do noise-cancelling headphones work?",
    "Write a limerick about a forgetful octopus.",
    "What is the Fermi paradox, and what are the main proposed answers to it?",
    "Convert this shell command to Python: find . -name '*.log' | xargs wc -l",
    "Which gentle exercises help after a sprained ankle has healed?",
    "Describe how the Silk Road shaped trade between China and Europe.",
]
HELDOUT_SYSTEM = [
    ("You are a museum guide who loves anecdotes.", "Tell me about the Terracotta Army."),
    ("You are a strict grammar teacher.", "Is it 'fewer people' or 'less people'? Why?"),
    ("Reply in exactly three sentences.", "Why do leaves change color in autumn?"),
    ("You are a pirate. Stay in character.", "How do I find north without a compass?"),
    ("You work at a hardware store.", "Which screws hold a heavy mirror on drywall?"),
    ("You review code carefully.", "Review this:\n\ndef avg(xs):\n    return sum(xs) / len(xs)"),
    ("Always answer with a numbered list.", "How can I make my mornings less stressful?"),
    ("You are a sommelier.", "What wine goes well with mushroom risotto?"),
    ("You talk to children aged 8 to 10.", "Why do we have to sleep every night?"),
]
HELDOUT_MULTI_TURN = [
    (
        "I'm planning a trip to Lisbon in May.",
        "Lovely! May is a great time for Lisbon: warm but not too hot. How can I help?",
        "Which neighborhoods are best to stay in for a first visit?",
    ),
    (
        "I just adopted a rescue greyhound.",
        "Congratulations! Greyhounds are gentle, quiet companions. What would you like to know?",
        "How much exercise does she need each day?",
    ),
    (
        "Can you help me with my chemistry homework?",
        "Sure! What's the problem?",
        "How many moles are in 36 grams of water?",
    ),
    (
        "I wrote this: def add(a, b): return a - b",
        "It subtracts instead of adding. Do you want me to fix it?",
        "Yes, and add a small test for it, please.",
    ),
    (
        "I want to start journaling.",
        "That's a great habit. Paper or an app?",
        "Paper. What should I write on the first page?",
    ),
    (
        "Let's play twenty questions. I'm thinking of an animal.",
        "Fun! Is it a mammal?",
        "Yes. What's your next question?",
    ),
    (
        "My laptop fan has been very loud lately.",
        "That often means dust or a busy background process. Have you checked the task manager?",
        "Yes, nothing unusual is running. What else can I try?",
    ),
    (
        "I'm learning to knit.",
        "Wonderful! What are you working on?",
        "A scarf, but the edges keep curling. How do I stop that?",
    ),
    (
        "Recommend a board game for four players.",
        "Try Ticket to Ride: it's easy to learn and fun in a group.",
        "We've played it a lot. Something more strategic?",
    ),
]
HELDOUT_FOREIGN = [
    (None, "Quelle est la différence entre un croissant et un pain au chocolat ?"),
    (None, "¿Cómo puedo mejorar mi pronunciación en inglés?"),
    (None, "Wie funktioniert eine Wärmepumpe?"),
    (None, "请推荐三本适合初学者阅读的中文小说。"),
    (None, "Écris un court poème sur la pluie à Paris."),
    ("Eres un profesor de historia.", "¿Por qué cayó el Imperio romano de Occidente?"),
    (None, "Was sind die Vorteile, in der Stadt Fahrrad zu fahren?"),
]


# Held-out user messages that ask for or about code: their kind is "code" whatever their form.
HELDOUT_CODE = {
    "Write a Python class that implements a simple LRU cache.",
    "Explain what a SQL JOIN is using an example with customers and orders.",
    "Write a regular expression that matches US phone numbers, and explain each part.",
    "Convert this shell command to Python: find . -name '*.log' | xargs wc -l",
    "Review this:\n\ndef avg(xs):\n    return sum(xs) / len(xs)",
    "I wrote this: def add(a, b): return a - b",
}
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
