"""A corpus that ships with the package: a small original text plus a procedural generator.

Why procedural: the demo must run offline, deterministically, and the loss must
fall clearly within a few hundred steps so that an injected instability stands
out against a healthy curve. Templated sentences over small word lists give a
character-level model plenty to learn quickly (spelling of a few hundred words,
agreement, punctuation) while staying varied enough not to be memorised in 300 steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources

import torch

# --- word lists ------------------------------------------------------------------------------

_ADJ = [
    "old", "young", "quiet", "clever", "tired", "brave", "small", "grey", "patient", "curious",
    "careful", "bright", "lonely", "cheerful", "stubborn", "gentle",
]
_PERSON = [
    "miller", "baker", "sailor", "teacher", "farmer", "weaver", "painter", "doctor", "child",
    "fisherman", "clerk", "gardener", "shepherd", "smith",
]
_ANIMAL = ["fox", "cat", "dog", "horse", "crow", "goat", "owl", "rabbit", "heron", "mouse"]
_THING = [
    "lantern", "basket", "letter", "boat", "bell", "kettle", "ladder", "map", "coat", "drum",
    "window", "garden", "bridge", "clock", "sack", "book",
]
_PLACE = [
    "the river", "the market", "the hill", "the old mill", "the harbour", "the forest",
    "the village", "the station", "the orchard", "the square", "the lighthouse", "the valley",
]
_TIME = [
    "at dawn", "in the evening", "before noon", "after the rain", "on sunday", "at night",
    "in winter", "every morning", "in the spring", "late in the day",
]
# (present 3rd person, past) pairs so the generator can keep tense consistent.
_VERB_T = [
    ("carries", "carried"), ("finds", "found"), ("mends", "mended"), ("paints", "painted"),
    ("sells", "sold"), ("watches", "watched"), ("buys", "bought"), ("hides", "hid"),
    ("opens", "opened"), ("cleans", "cleaned"), ("loses", "lost"), ("builds", "built"),
]
_VERB_I = [
    ("walks", "walked"), ("sleeps", "slept"), ("sings", "sang"), ("waits", "waited"),
    ("works", "worked"), ("runs", "ran"), ("rests", "rested"), ("listens", "listened"),
]
_NUM = ["two", "three", "four", "five", "six", "seven", "ten", "twelve"]
_WEATHER = ["cold", "warm", "windy", "grey", "clear", "wet", "still", "bright"]
_FEEL = ["happy", "worried", "hungry", "calm", "proud", "sleepy", "surprised"]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _noun_phrase(r: random.Random) -> str:
    noun = r.choice(_PERSON + _ANIMAL)
    if r.random() < 0.6:
        return "the " + r.choice(_ADJ) + " " + noun
    return "the " + noun


def _object(r: random.Random) -> str:
    roll = r.random()
    thing = r.choice(_THING)
    if roll < 0.3:
        return r.choice(_NUM) + " " + thing + "s"  # regular plurals only: every _THING takes -s
    if roll < 0.6:
        return _a(r.choice(_ADJ) + " " + thing)
    return "the " + thing


def _sentence(r: random.Random) -> str:
    """One sentence from a handful of templates; tense is chosen once per sentence."""
    past = r.random() < 0.5
    t = 1 if past else 0
    kind = r.randrange(7)
    subj = _noun_phrase(r)
    if kind == 0:
        s = f"{subj} {r.choice(_VERB_T)[t]} {_object(r)} to {r.choice(_PLACE)} {r.choice(_TIME)}"
    elif kind == 1:
        s = f"{subj} {r.choice(_VERB_I)[t]} near {r.choice(_PLACE)}"
    elif kind == 2:
        s = (f"{r.choice(_TIME)} {subj} {r.choice(_VERB_T)[t]} {_object(r)}, "
             f"and {_noun_phrase(r)} {r.choice(_VERB_I)[t]}")
    elif kind == 3:
        be = "was" if past else "is"
        s = f"the weather {be} {r.choice(_WEATHER)}, so {subj} {r.choice(_VERB_I)[t]} {r.choice(_TIME)}"
    elif kind == 4:
        be = "was" if past else "is"
        s = f"{subj} {be} {r.choice(_FEEL)} because {_noun_phrase(r)} {r.choice(_VERB_T)[t]} {_object(r)}"
    elif kind == 5:
        s = f"at {r.choice(_PLACE)} {subj} {r.choice(_VERB_T)[t]} {_object(r)} and {r.choice(_VERB_I)[t]}"
    else:
        who = r.choice(_PERSON)
        s = f"\"where is the {r.choice(_THING)}?\" asked the {who}"
    i = 1 if s[0] == '"' else 0
    return s[:i] + s[i].upper() + s[i + 1:] + "."


def generate_corpus(n_chars: int = 200_000, seed: int = 0) -> str:
    """Deterministic English-like text of at least ``n_chars`` characters.

    Sentences are grouped into short paragraphs (blank line between) so the
    model also learns layout; the same ``(n_chars, seed)`` always yields the same text.
    """
    r = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        para = " ".join(_sentence(r) for _ in range(r.randint(2, 5)))
        parts.append(para)
        size += len(para) + 2
    return "\n\n".join(parts) + "\n"


def shipped_text() -> str:
    """The small original text file that ships in the package (``corpus.txt``)."""
    return resources.files("fp8scope.demo").joinpath("corpus.txt").read_text(encoding="utf-8")


def load_corpus(n_chars: int = 200_000, seed: int = 0) -> str:
    """The demo corpus: the shipped text followed by generated sentences (no downloads)."""
    return shipped_text() + "\n" + generate_corpus(n_chars, seed)


# --- tokenizer and batches -------------------------------------------------------------------


@dataclass
class CharTokenizer:
    """Character-level tokenizer; the vocabulary is the sorted set of characters in the text."""

    chars: list[str]

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    def __post_init__(self) -> None:
        self._index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        try:
            return torch.tensor([self._index[c] for c in text], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class Batches:
    """Random (x, y) windows over a token tensor; y is x shifted by one.

    Uses its own torch.Generator so batches are reproducible given the seed and
    independent of whatever else consumes the global RNG (e.g. the monitor).
    """

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        if data.numel() <= seq_len + 1:
            raise ValueError(f"corpus of {data.numel()} tokens is too short for seq_len={seq_len}")
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.device = torch.device(device)
        self.gen = torch.Generator().manual_seed(seed)
        # Precomputed index offsets: one gather per batch instead of a Python loop.
        self._arange = torch.arange(seq_len + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (self.batch_size,),
                               generator=self.gen)
        chunk = self.data[starts[:, None] + self._arange]
        x, y = chunk[:, :-1], chunk[:, 1:]
        if self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y

    def __iter__(self):
        while True:
            yield self.next()


def make_data(n_chars: int = 200_000, seed: int = 0, val_fraction: float = 0.1
              ) -> tuple[CharTokenizer, torch.Tensor, torch.Tensor]:
    """Corpus -> (tokenizer, train tokens, val tokens). The split is a contiguous tail."""
    text = load_corpus(n_chars, seed)
    tok = CharTokenizer.from_text(text)
    ids = tok.encode(text)
    n_val = int(len(ids) * val_fraction)
    return tok, ids[: len(ids) - n_val], ids[len(ids) - n_val:]
