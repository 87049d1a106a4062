"""General chat instructions for distillation data, written offline from templates and topic lists.

Why: the offline benchmark suite draws on Python's documentation, HumanEval and arithmetic, so a
drafter distilled on it alone sees little of what people ask a chat model (writing, role play,
explanations, advice, reasoning, translation, extraction), and on such questions its agreement with
the target fell. These prompts widen what the target's continuations cover. They are built here
from the lists below and the stdlib's docstrings; the training-data builder passes the evaluation
questions as `exclude`, so none it keeps shares a 13-word n-gram with one (heads/contamination.py).

The kinds grew twice: first explanations, writing, role play, advice, comparisons, reasoning,
translation, extraction and code; then summaries and questions over a passage, rewriting, science
and formulas, arithmetic word problems, history and books, and small talk, because a draft trained on
the first set still agreed with the target far less on a Spec-Bench-style file than on its own
validation data (experiments/README.md, "Figures moved out of code and configs").
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
    "the Vikings", "electric guitars", "the immune response to allergies", "space tourism", "the Aztecs",
    "photosynthetic algae", "the gig economy", "volunteering", "the history of the bicycle", "opera",
    "self-driving cars", "the Greek gods", "personal finance", "the Arctic", "video games", "tea",
    "the human brain", "mountaineering", "the French language", "smart homes", "the Pyramids of Giza",
    "mushrooms", "the Titanic", "cybersecurity", "the history of medicine", "climate adaptation",
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
    "summarize": (
        "Summarize the following passage in two sentences.\n\n{paragraph}",
        "Explain this passage in plain words for {audience}.\n\n{paragraph}",
        "What is the main idea of this text? Answer briefly.\n\n{paragraph}",
    ),
    "passage_qa": (
        "Answer using only the passage below: what problem does it describe, and what is the solution?"
        "\n\nPassage: {paragraph}",
        "Passage: {paragraph}\n\nQuestion: Based on the passage, what should a programmer watch out for?",
        "Read the passage and write two questions it answers, each with its answer.\n\n{paragraph}",
    ),
    "rewrite": (
        "Rewrite this sentence in a more formal tone: \"{sentence}\"",
        "Rewrite the following text so that {audience} can understand it:\n\n{paragraph}",
        "Paraphrase this sentence in three different ways: \"{sentence}\"",
    ),
    "stem": (
        "How does {stem} work? Explain the science behind it.",
        "What is the formula for {formula}, and how is it used? Give an example.",
        "Explain {stem} step by step, as a physics teacher would.",
        "Why is {topic} important for science? Give two examples.",
    ),
    "math": (
        "What is {pct}% of {big}? Show your work.",
        "A jacket costs ${price} and is on sale for {pct}% off. What is the sale price?",
        "Solve for x: {a}x + {b} = {c}. Explain each step.",
        "A rectangle is {w} cm wide and {h} cm long. What are its area and perimeter?",
        "If I invest ${big} at {r}% interest per year, compounded annually, how much will I have after {n} years?",
        "A train travels {d} km in {hours} hours. What is its average speed in km/h?",
    ),
    "humanities": (
        "What were the main causes of {event}?",
        "Describe the importance of {person} in history.",
        "Discuss the main themes of {book}.",
        "How did {event} change everyday life for ordinary people?",
        "Write a short biography of {person} for a school report.",
    ),
    "chat": (
        "Tell me a fun fact about {topic}.",
        "Can you recommend three books about {topic}? Say why for each.",
        "I'm feeling stressed about {task}. Do you have any advice?",
        "List ten interesting facts about {topic}.",
        "Write a dialogue between {role} and {role2} about {topic}.",
        "What would happen if {topic} suddenly disappeared? Be creative.",
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
    "I have lived in this city for five years.", "Can you recommend a good restaurant nearby?",
    "The children are playing in the garden.", "I forgot my umbrella at the office.",
    "What time does the next bus leave?", "She is reading a book about ancient history.",
    "Thank you very much for your help yesterday.", "The meeting has been moved to Thursday afternoon.",
    "We should protect the environment for future generations.", "My favorite season is autumn.",
)

STEM = ("a refrigerator", "a rainbow", "GPS navigation", "a nuclear reactor", "an electric motor",
        "a microwave oven", "the greenhouse effect", "a lithium-ion battery", "an airplane wing", "a telescope",
        "the heart's circulation", "a compass", "noise-cancelling headphones", "a solar cell", "fermentation")

FORMULAS = ("the area of a circle", "kinetic energy", "compound interest", "the Pythagorean theorem",
            "Ohm's law", "density", "the volume of a sphere", "average speed", "the slope of a line",
            "simple probability")

EVENTS = ("World War I", "the fall of the Berlin Wall", "the American Revolution", "the Black Death",
          "the Industrial Revolution in Britain", "the collapse of the Western Roman Empire",
          "the Meiji Restoration", "the Great Depression", "the abolition of slavery", "the space race")

PEOPLE = ("Leonardo da Vinci", "Marie Curie", "Nelson Mandela", "Confucius", "Ada Lovelace", "Cleopatra",
          "Isaac Newton", "Mahatma Gandhi", "Frida Kahlo", "Charles Darwin", "Shakespeare", "Genghis Khan")

BOOKS = ("Hamlet", "Pride and Prejudice", "Nineteen Eighty-Four", "To Kill a Mockingbird", "The Odyssey",
         "Moby-Dick", "Don Quixote", "Frankenstein", "The Great Gatsby", "Crime and Punishment")

NAMES = ("Alice", "Bruno", "Carmen", "Dmitri", "Esther", "Felix", "Gina", "Hassan", "Ivy", "Jamal")


def _fill(template: str, rng: random.Random, paragraphs: list[str]) -> str:
    topic, topic2 = rng.sample(TOPICS, 2)
    name, name2, name3 = rng.sample(NAMES, 3)
    role, role2 = rng.sample(ROLES, 2)
    a, x = rng.randint(2, 9), rng.randint(-10, 10)
    b = rng.randint(1, 20)
    heads = rng.randint(10, 40)
    cows = rng.randint(1, heads - 1)
    start, step = rng.randint(1, 9), rng.randint(2, 7)
    values = {
        "topic": topic, "topic2": topic2, "place": rng.choice(PLACES), "role": role, "role2": role2,
        "audience": rng.choice(AUDIENCES), "language": rng.choice(LANGUAGES), "item": rng.choice(ITEMS),
        "task": rng.choice(TASKS), "sentence": rng.choice(SENTENCES), "name": name, "name2": name2,
        "name3": name3, "total": 3 * rng.randint(5, 40), "heads": heads, "legs": 2 * heads + 2 * cows,
        "seq": ", ".join(str(start + step * i) for i in range(5)), "hour": rng.randint(6, 11),
        "hours": rng.randint(2, 6), "speed": rng.choice((60, 70, 80, 90, 100)), "k": rng.randint(3, 10),
        "paragraph": rng.choice(paragraphs) if paragraphs else topic, "stem": rng.choice(STEM),
        "formula": rng.choice(FORMULAS), "event": rng.choice(EVENTS), "person": rng.choice(PEOPLE),
        "book": rng.choice(BOOKS), "pct": rng.choice((5, 10, 15, 20, 25, 30, 40, 75)),
        "big": rng.choice((80, 120, 250, 400, 1500, 2000, 5000)), "price": rng.randint(20, 200),
        "a": a, "b": b, "c": a * x + b, "w": rng.randint(3, 30), "h": rng.randint(3, 30),
        "r": rng.choice((2, 3, 4, 5, 6)), "n": rng.randint(2, 10), "d": rng.randint(50, 600),
    }
    return template.format(**values)


# data.instructions of every drafter shipped so far (draft and Medusa heads: 4800; earlier ones 1200, 2400), drawn
# with the data's first seed (1): what the held-apart builders keep out (experiments/*_heldapart.py)
SHIPPED_DRAWS = (1200, 2400, 4800)


def instruction_prompts(count: int, seed: int, exclude: Iterable[str] = ()) -> list[str]:
    """`count` distinct instructions, kinds interleaved, reproducible from `seed`. No paragraph quoted and
    no instruction made shares a 13-word n-gram with a text of `exclude` (the evaluation turns); with
    nothing excluded the draw is the one earlier drafters were trained on."""
    from heads.contamination import EvalIndex, EvalTurn

    rng = random.Random(f"specdec-instructions-{seed}")
    index = EvalIndex(EvalTurn("excluded", str(i), 0, t) for i, t in enumerate(exclude))
    paragraphs = [p for p in docstring_paragraphs() if index.clean(p)]
    kinds = sorted(TEMPLATES)
    found: list[str] = []
    seen: set[str] = set()
    for attempt in range(count * 20):  # distinctness can run out for tiny template sets; stop anyway
        if len(found) == count:
            break
        kind = kinds[attempt % len(kinds)]
        prompt = _fill(rng.choice(TEMPLATES[kind]), rng, paragraphs)
        if prompt not in seen and index.clean(prompt):
            seen.add(prompt)
            found.append(prompt)
    return found
