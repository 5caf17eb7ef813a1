"""The training text of ``tiny-trained``: simple English from a small hand-written grammar.

A byte-level model this small learns spelling, word boundaries and sentence shape from a
few hundred KB only if the text is regular; a grammar gives that regularity, and a seeded
``random.Random`` makes the corpus the same bytes on every machine and Python version
(only ``choice``/``randrange``/``shuffle`` on lists are used, which are stable).

Each document is a short paragraph or an instruction and its answer; the trainer wraps
every document in BOS ... EOS, so the model learns to start after BOS (the byte
tokenizer prepends it to every prompt) and to stop.
"""

from __future__ import annotations

import random

NOUNS = [
    ("cat", "cats"),
    ("dog", "dogs"),
    ("bird", "birds"),
    ("girl", "girls"),
    ("boy", "boys"),
    ("man", "men"),
    ("woman", "women"),
    ("teacher", "teachers"),
    ("farmer", "farmers"),
    ("child", "children"),
    ("friend", "friends"),
    ("king", "kings"),
    ("baker", "bakers"),
    ("fox", "foxes"),
    ("horse", "horses"),
]
THINGS = [
    "ball",
    "book",
    "box",
    "apple",
    "cake",
    "letter",
    "hat",
    "cup",
    "key",
    "bag",
    "boat",
    "map",
    "song",
    "flower",
    "coat",
    "bell",
]
ADJS = [
    "small",
    "big",
    "red",
    "old",
    "little",
    "happy",
    "green",
    "quiet",
    "brown",
    "warm",
    "bright",
    "kind",
    "new",
    "blue",
    "tired",
]
# Past-tense verbs that take an object.
TRANSITIVE = [
    "saw",
    "found",
    "liked",
    "took",
    "made",
    "gave away",
    "wanted",
    "lost",
    "opened",
    "painted",
    "carried",
    "held",
]
# Past-tense verb phrases that end a sentence.
INTRANSITIVE = [
    "sat on the mat",
    "ran to the park",
    "slept in the sun",
    "walked home",
    "sang a song",
    "went to the market",
    "played in the garden",
    "looked at the sky",
    "waited by the door",
    "jumped over the fence",
    "swam in the river",
    "laughed",
    "smiled",
    "read by the window",
]
PLACES = [
    "in the garden",
    "by the river",
    "at the market",
    "in the kitchen",
    "near the old tree",
    "on the hill",
    "at school",
    "in the forest",
]
TIMES = [
    "In the morning",
    "After lunch",
    "One day",
    "At night",
    "Later",
    "Then",
    "On Sunday",
    "Every day",
]
FEELINGS = ["happy", "sad", "tired", "glad", "hungry", "sleepy", "proud"]
NUMBER_WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
PRIMES = ["two", "three", "five", "seven", "eleven", "thirteen"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown"]
ANIMALS = ["cat", "dog", "bird", "fox", "horse", "cow", "fish", "duck"]
FRUITS = ["apple", "pear", "plum", "orange", "banana", "grape"]
GREETINGS = ["Hello", "Hi", "Good morning", "Good day"]
ASSISTANTS = ["terse", "helpful", "kind", "friendly", "short"]


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _subject(r: random.Random) -> tuple[str, bool]:
    """A noun phrase and whether it is plural."""
    singular, plural = r.choice(NOUNS)
    form = r.randrange(6)
    if form == 0:
        return f"the {singular}", False
    if form == 1:
        return _a(f"{r.choice(ADJS)} {singular}"), False
    if form == 2:
        return f"the {r.choice(ADJS)} {singular}", False
    if form == 3:
        return f"my {singular}", False
    if form == 4:
        return f"the {plural}", True
    return f"two {r.choice(ADJS)} {plural}", True


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _object(r: random.Random) -> str:
    thing = r.choice(THINGS)
    form = r.randrange(4)
    if form == 0:
        return _a(thing)
    if form == 1:
        return f"the {thing}"
    if form == 2:
        return _a(f"{r.choice(ADJS)} {thing}")
    return f"the {r.choice(ADJS)} {thing}"


def sentence(r: random.Random) -> str:
    subj, plural = _subject(r)
    form = r.randrange(8)
    if form == 0:
        return f"{_cap(subj)} {r.choice(TRANSITIVE)} {_object(r)}."
    if form == 1:
        return f"{_cap(subj)} {r.choice(INTRANSITIVE)}."
    if form == 2:
        return f"{r.choice(TIMES)}, {subj} {r.choice(INTRANSITIVE)}."
    if form == 3:
        return f"{_cap(subj)} {r.choice(TRANSITIVE)} {_object(r)} {r.choice(PLACES)}."
    if form == 4:
        be = "were" if plural else "was"
        return f"{_cap(subj)} {be} very {r.choice(FEELINGS)}."
    if form == 5:
        return f"It was {_a(r.choice(ADJS))} day {r.choice(PLACES)}."
    if form == 6:
        pron = "They" if plural else r.choice(["He", "She"])
        return (
            f"{_cap(subj)} {r.choice(INTRANSITIVE)}, and {pron.lower()} {r.choice(INTRANSITIVE)}."
        )
    return f"{r.choice(TIMES)}, {subj} {r.choice(TRANSITIVE)} {_object(r)}."


def story(r: random.Random) -> str:
    return " ".join(sentence(r) for _ in range(r.randrange(1, 4)))


def instruction(r: random.Random) -> str:
    """An instruction and a short answer, sometimes after a one-line system prompt."""
    form = r.randrange(7)
    if form == 0:
        n = r.randrange(2, 7)
        q, a = f"Count to {NUMBER_WORDS[n - 1]}.", _cap(", ".join(NUMBER_WORDS[:n])) + "."
    elif form == 1:
        q, a = "Name a prime.", f"{_cap(r.choice(PRIMES))} is a prime."
    elif form == 2:
        q, a = "Say hello.", f"{r.choice(GREETINGS)}!"
    elif form == 3:
        kind, items = r.choice([("color", COLORS), ("animal", ANIMALS), ("fruit", FRUITS)])
        q, a = f"Name a {kind}.", f"{_cap(r.choice(items))}."
    elif form == 4:
        q, a = r.choice(GREETINGS) + "!", r.choice(["Hello! How are you?", "Hi there!"])
    elif form == 5:
        q, a = "Tell me a story.", story(r)
    else:
        q, a = "How are you?", f"I am {r.choice(FEELINGS)}, thank you."
    if r.randrange(3) == 0:
        q = f"You are {_a(r.choice(ASSISTANTS))} assistant. {q}"
    return f"{q} {a}"


def documents(seed: int = 0, num_bytes: int = 150_000) -> list[str]:
    """Documents until their UTF-8 size (plus one separator each) reaches ``num_bytes``."""
    r = random.Random(seed)
    docs: list[str] = []
    total = 0
    while total < num_bytes:
        doc = instruction(r) if r.randrange(4) == 0 else story(r)
        docs.append(doc)
        total += len(doc.encode("utf-8")) + 1
    return docs


if __name__ == "__main__":  # pragma: no cover
    print("\n".join(documents()[:20]))
