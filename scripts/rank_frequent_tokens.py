"""Rank a tokenizer's tokens by how often they occur in general text and code, for the draft
model's reduced vocabulary (src/specdec/models/reduced_vocabulary.py; FR-Spec, Zhao et al. 2025).

The ranking is made from sources unrelated to the benchmarks: English word frequencies from
`wordfreq` (Wikipedia, subtitles, news, books, web text; each word counted as it appears after a
space, capitalised after a space, capitalised and bare) and a sample of Python's own standard
library (code). It is written to src/specdec/data/frequent_tokens/<tokenizer digest>.npy and
shipped: a run needs neither source. Regenerate with:

    .venv/bin/pip install wordfreq==3.1.1
    .venv/bin/python scripts/rank_frequent_tokens.py [DRAFT.gguf]
"""
from __future__ import annotations

import argparse
import random
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np

from specdec.backends.bindings.ik_llama import binding
from specdec.backends.llama_family import LlamaFamilyBackend
from specdec.models.reduced_vocabulary import RANKINGS_DIR, ranking_path, tokenizer_digest
from specdec.models.registry import DRAFT, default_path

WORDS = 100_000  # wordfreq's most frequent English words
CODE_CHARACTERS = 8_000_000  # of the standard library's sources, files in a seeded order
PROSE_SHARE = 0.9  # the rest: code
# How a word appears in text: after a space, capitalised after a space, starting a line, bare.
WORD_FORMS = ((lambda w: " " + w, 0.8), (lambda w: " " + w.capitalize(), 0.1),
              (lambda w: w.capitalize(), 0.05), (lambda w: w, 0.05))


def prose_counts(tokenize) -> Counter:
    import wordfreq

    counts: Counter = Counter()
    for word in wordfreq.top_n_list("en", WORDS):
        frequency = wordfreq.word_frequency(word, "en")
        for form, share in WORD_FORMS:
            for token in tokenize(form(word)):
                counts[token] += frequency * share
    return counts


def code_counts(tokenize) -> Counter:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    random.Random(0).shuffle(files)
    counts: Counter = Counter()
    seen = 0
    for path in files:
        source = path.read_text(errors="replace")
        counts.update(tokenize(source))
        seen += len(source)
        if seen >= CODE_CHARACTERS:
            break
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=str(default_path(DRAFT)), help="a GGUF with the tokenizer")
    args = parser.parse_args()
    backend = LlamaFamilyBackend(binding(), args.model, n_ctx=256)
    tokenize = lambda text: backend.tokenize(text, add_special=False)  # noqa: E731
    prose, code = prose_counts(tokenize), code_counts(tokenize)
    total_prose, total_code = sum(prose.values()), sum(code.values())
    score = {token: PROSE_SHARE * prose[token] / total_prose + (1 - PROSE_SHARE) * code[token] / total_code
             for token in prose.keys() | code.keys()}
    ranking = np.array(sorted(score, key=lambda token: (-score[token], token)), dtype=np.int32)
    RANKINGS_DIR.mkdir(parents=True, exist_ok=True)
    out = ranking_path(tokenizer_digest(args.model))
    np.save(out, ranking)
    print(f"{len(ranking)} tokens ranked -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
