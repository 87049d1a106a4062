"""General chat instructions for distillation data, written offline from templates and topic lists.

Why: the offline benchmark suite draws on Python's documentation, HumanEval and arithmetic, so a
drafter distilled on it alone sees little of what people ask a chat model (writing, role play,
explanations, advice, reasoning, translation, extraction), and on such questions its agreement with
the target halved. These prompts widen what the target's continuations cover. They share no text
with any benchmark file: they are built here from the lists below and the stdlib's docstrings.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from specdec.data import docstring_paragraphs

TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "climate change", "the printing press",
    "vaccines", "the Roman Empire", "plate tectonics", "machine learning", "the water cycle",
    "the Silk Road", "electric cars", "the human immune system", "volcanoes", "the Renaissance",
    "renewable energy", "the Industrial Revolution", "DNA", "the Moon landing", "coral reefs",
    "inflation", "the Great Wall of China", "antibiotics", "recycling", "the Cold War",
    "quantum computing", "honeybees", "the stock market", "ancient Egypt", "sleep",
    "social media", "the Amazon rainforest", "blockchain", "the Olympic Games", "jazz",
    "the theory of evolution", "earthquakes", "remote work", "the internet", "gravity",
    "the Mongol Empire", "nutrition", "solar panels", "democracy", "the periodic table",
    "meditation", "deforestation", "the Byzantine Empire", "artificial intelligence", "tides",
    "the Beatles", "urban gardening", "the Enlightenment", "supply and demand", "rainbows",
    "the Apollo program", "bird migration", "public libraries", "the metric system", "chess",
    "the Maya civilization", "wind turbines", "the human heart", "credit scores", "glaciers",
    "the Harlem Renaissance", "3D printing", "ocean currents", "the Magna Carta", "bacteria",
    "minimalism", "the Ottoman Empire", "nuclear power", "time management", "dinosaurs",
    "the printing of money", "impressionist painting", "cloud computing", "the Nile River", "friendship",
)

PLACES = ("Paris", "Tokyo", "Cairo", "Rio de Janeiro", "Iceland", "New York", "Kenya", "Rome", "Peru",
          "Vietnam", "Norway", "Morocco", "Sydney", "Istanbul", "Mexico City", "Scotland")

ROLES = ("a pirate captain", "a medieval knight", "a detective in 1920s London", "a friendly robot",
         "a travel guide", "a chef at a busy restaurant", "an astronaut on the space station",
         "a wise old wizard", "a museum curator", "a sports coach", "a librarian", "a time traveler",
         "Sherlock Holmes", "a park ranger", "a startup founder", "a kindergarten teacher")

AUDIENCES = ("a five-year-old", "a high school student", "a busy executive", "a grandparent", "a beginner",
             "an expert")

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese")

ITEMS = ("a smartphone", "a bicycle", "a coffee maker", "a pair of running shoes", "a laptop", "a tent",
         "a board game", "a houseplant", "a backpack", "a kitchen knife")

TASKS = ("learning a new language", "starting a vegetable garden", "running a first marathon",
         "saving money for a house", "preparing for a job interview", "moving to a new city",
         "writing a novel", "learning to play the guitar", "starting a small business",
         "getting better sleep", "organizing a small wedding", "learning to code")

TEMPLATES: dict[str, tuple[str, ...]] = {
    "explain": (
        "Explain {topic} to {audience}.",
        "What is {topic}, and why does it matter?",
        "Give me a short overview of {topic}.",
        "What are the most common misconceptions about {topic}?",
        "How has {topic} changed the world? Give three examples.",
        "Write five quiz questions about {topic}, with answers.",
    ),
    "writing": (
        "Write a short poem about {topic}.",
        "Write a persuasive paragraph arguing that schools should teach more about {topic}.",
        "Draft a blog post introduction about {topic}.",
        "Write a short story that takes place in {place} and involves {topic}.",
        "Write a product description for {item}.",
        "Compose a polite email to a colleague asking for feedback on a report about {topic}.",
        "Write a travel blog post about a trip to {place}, highlighting culture and food.",
        "Write a catchy slogan and a one-paragraph advertisement for {item}.",
    ),
    "roleplay": (
        "Pretend you are {role}. Introduce yourself and describe a typical day.",
        "You are {role}. A visitor asks you about {topic}. What do you say?",
        "Act as {role} and give advice to someone {task}.",
        "Imagine you are {role} visiting {place}. Describe what you see.",
    ),
    "advice": (
        "What are some tips for {task}?",
        "Make a step-by-step plan for {task} over the next three months.",
        "What mistakes do people often make when {task}, and how can I avoid them?",
        "I want to buy {item}. What should I look for?",
        "Plan a three-day trip to {place} on a budget.",
    ),
    "compare": (
        "Compare {topic} and {topic2}: what do they have in common and how do they differ?",
        "What are the pros and cons of {topic}?",
        "Which is more important for the future, {topic} or {topic2}? Argue both sides.",
    ),
    "reasoning": (
        "If {name} is taller than {name2}, and {name2} is taller than {name3}, who is the shortest? Explain.",
        "{name} has twice as many books as {name2}. Together they have {total} books. How many does each have?",
        "A farmer has chickens and cows. There are {heads} heads and {legs} legs. How many of each animal?",
        "Is the following argument valid? All cats are mammals. Some mammals can swim. Therefore some cats "
        "can swim. Explain your reasoning.",
        "What comes next in the sequence {seq}? Explain the pattern.",
        "{name} leaves at {hour}:00 and drives for {hours} hours at {speed} km/h. How far has {name} gone, "
        "and when does {name} arrive?",
    ),
    "translate": (
        "Translate into {language}: \"{sentence}\"",
        "How do you say \"{sentence}\" in {language}?",
    ),
    "extract": (
        "Read the text and list its three main points as bullet points.\n\n{paragraph}",
        "Extract every technical term from the following text and define each in one sentence.\n\n{paragraph}",
        "Write a one-sentence headline for this text.\n\n{paragraph}",
        "Turn the following text into a short FAQ with three questions and answers.\n\n{paragraph}",
    ),
    "code": (
        "Write a Python function that checks whether a string is a palindrome, and explain it.",
        "Write a Python function that returns the {k} most common words in a text.",
        "Explain the difference between a list and a tuple in Python, with examples.",
        "Write a SQL query that finds the {k} customers with the highest total orders.",
        "Write a JavaScript function that removes duplicates from an array.",
        "Write a Python class for a bank account with deposit and withdraw methods.",
        "How does binary search work? Write it in Python.",
        "Write a bash command that counts the lines in every .txt file in a folder.",
    ),
}

SENTENCES = (
    "Where is the nearest train station?", "I would like a cup of coffee, please.",
    "The weather is beautiful today.", "Could you help me carry these bags?",
    "We are meeting our friends for dinner tonight.", "This book changed the way I think about history.",
    "The museum opens at nine in the morning.", "My brother is learning to play the piano.",
    "Please turn off the lights when you leave.", "How much does this ticket cost?",
)

NAMES = ("Alice", "Bruno", "Carmen", "Dmitri", "Esther", "Felix", "Gina", "Hassan", "Ivy", "Jamal")


def _fill(template: str, rng: random.Random, paragraphs: list[str]) -> str:
    topic, topic2 = rng.sample(TOPICS, 2)
    name, name2, name3 = rng.sample(NAMES, 3)
    heads = rng.randint(10, 40)
    cows = rng.randint(1, heads - 1)
    start, step = rng.randint(1, 9), rng.randint(2, 7)
    values = {
        "topic": topic, "topic2": topic2, "place": rng.choice(PLACES), "role": rng.choice(ROLES),
        "audience": rng.choice(AUDIENCES), "language": rng.choice(LANGUAGES), "item": rng.choice(ITEMS),
        "task": rng.choice(TASKS), "sentence": rng.choice(SENTENCES), "name": name, "name2": name2,
        "name3": name3, "total": 3 * rng.randint(5, 40), "heads": heads, "legs": 2 * heads + 2 * cows,
        "seq": ", ".join(str(start + step * i) for i in range(5)), "hour": rng.randint(6, 11),
        "hours": rng.randint(2, 6), "speed": rng.choice((60, 70, 80, 90, 100)), "k": rng.randint(3, 10),
        "paragraph": rng.choice(paragraphs) if paragraphs else topic,
    }
    return template.format(**values)


def instruction_prompts(count: int, seed: int, exclude: Iterable[str] = ()) -> list[str]:
    """`count` distinct instructions, kinds interleaved, reproducible from `seed`. Paragraphs found in
    any text of `exclude` (the benchmark's turns) are never quoted."""
    rng = random.Random(f"specdec-instructions-{seed}")
    excluded = list(exclude)
    paragraphs = [p for p in docstring_paragraphs() if not any(p in text for text in excluded)]
    kinds = sorted(TEMPLATES)
    found: list[str] = []
    seen: set[str] = set()
    for attempt in range(count * 20):  # distinctness can run out for tiny template sets; stop anyway
        if len(found) == count:
            break
        kind = kinds[attempt % len(kinds)]
        prompt = _fill(rng.choice(TEMPLATES[kind]), rng, paragraphs)
        if prompt not in seen:
            seen.add(prompt)
            found.append(prompt)
    return found
