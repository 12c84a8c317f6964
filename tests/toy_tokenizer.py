"""A small byte-level BPE trained on pseudo-words, for bench tests (no model files needed)."""

from __future__ import annotations

import random
from typing import Any


def make_tokenizer() -> Any:
    """A small byte-level BPE trained on pseudo-words (no model files needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 7)))
        for _ in range(400)
    ] + ["Yes", "No", "Answer", "with", "or"]
    corpus = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=3000,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<eos>"],
            show_progress=False,
        ),
    )
    return tok
