"""The lab's training text, made here rather than downloaded.

A small probabilistic grammar writes short stories about animals in places, plus lines of
sums ("17 + 25 = 42"). It is tiny and regular on purpose: a 100k-parameter GPT brings the
byte-level loss from ln(256) = 5.5 down to about 1.5 within a few hundred steps on a laptop CPU,
so a notebook shows learning, not noise. ``data/corpus.txt`` is this module's output with the
default seed; ``python -m dlab corpus`` writes it again, and a test checks they agree.
"""
from __future__ import annotations

import random

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kit", "Lena"]
ANIMALS = ["fox", "owl", "cat", "dog", "hare", "bee", "crow", "mole", "frog", "seal"]
ADJECTIVES = ["small", "quick", "quiet", "brave", "sleepy", "clever", "old", "bright", "shy"]
PLACES = ["the forest", "the river", "the hill", "the market", "the garden", "the harbour",
          "the library", "the meadow", "the station", "the bridge"]
VERBS = ["found", "followed", "helped", "watched", "called", "painted", "met", "counted"]
THINGS = ["a red kite", "three stones", "a lost key", "a blue boat", "some bread", "a map",
          "a tin drum", "two apples", "a paper star", "a warm coat"]
ENDINGS = ["and they went home together.", "and the day was good.", "and nobody saw it.",
           "and it began to rain.", "and the bells rang at noon.", "and then they slept."]


def _story(rng: random.Random) -> str:
    name, animal, adj = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(ADJECTIVES)
    place, verb, thing = rng.choice(PLACES), rng.choice(VERBS), rng.choice(THINGS)
    lines = [f"{name} lived near {place} with a {adj} {animal}.",
             f"One morning the {animal} {verb} {thing} by {rng.choice(PLACES)},",
             rng.choice(ENDINGS)]
    if rng.random() < 0.5:
        lines.append(f"{name} said: \"{rng.choice(ADJECTIVES)} {animal}, {rng.choice(ADJECTIVES)} day.\"")
    return " ".join(lines)


def _sum(rng: random.Random) -> str:
    a, b = rng.randrange(100), rng.randrange(100)
    return f"{a} + {b} = {a + b}."


def make_corpus(n_bytes: int = 400_000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        text = _story(rng) if rng.random() < 0.8 else _sum(rng)
        parts.append(text)
        size += len(text) + 1
    return "\n".join(parts)[:n_bytes]
