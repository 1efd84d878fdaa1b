"""The demo: a tiny GPT, a shipped corpus, and planted FP8 instabilities.

Why it exists: fp8scope must be shown (and tested) on a run that really goes
wrong for a known reason, on any laptop, offline. ``python -m fp8scope.demo.train``
trains it; ``examples/train_tiny_gpt.py`` is the same loop written out.
"""

from .corpus import Batches, CharTokenizer, generate_corpus, load_corpus, make_data
from .inject import Injection, Injector, parse_spec
from .tiny_gpt import GPTConfig, TinyGPT

__all__ = [
    "GPTConfig", "TinyGPT",
    "Batches", "CharTokenizer", "generate_corpus", "load_corpus", "make_data",
    "Injection", "Injector", "parse_spec",
]
