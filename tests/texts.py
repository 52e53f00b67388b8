"""Texts for the real checkpoint beyond the two its tokens.json holds: many, of several kinds, with no
download. compare's tolerances are calibrated on some of them (bench/calibrate.py) and must hold on the
others, so the corpus is fixed, in texts.json beside this file. It was drawn, in a fixed order, from what
CPython 3.11 ships (another version's text differs, hence the file):

- prose: the paragraphs of the language reference's topics (pydoc_data, what `help("if")` prints);
- code: the standard library's own source, a function at a time;
- lists: code points of many scripts with the Unicode database's names for them.

    python tests/texts.py          # print the corpus, one text a line
    python tests/texts.py --draw   # draw it again from this Python into texts.json
"""

from __future__ import annotations

import inspect
import json
import sys
import re
import unicodedata
from pathlib import Path

FILE = Path(__file__).with_name("texts.json")
CALIBRATION = range(0, 28)  # the texts bench/calibrate.py fits compare's tolerances on
HELD_OUT = range(28, 40)  # texts no tolerance was fitted on: they must not move a verdict
WORDS = 40  # a text's length in words (about 50 to 70 tokens)
BATCH = 4  # texts a run
LENGTHS = (36, 31, 26, 20)  # each text's tokens in its batch: padded rows of several lengths
TESTS = 6  # the batch the tests of the real checkpoint run (tests/stacks/smollm2.py)


def batch_tokens(checkpoint, batch: int) -> list[list[int]]:
    """Batch `batch`'s texts as the checkpoint's tokenizer cuts them, each to its LENGTHS tokens: what
    --tokens reads."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts = corpus()[batch * BATCH:(batch + 1) * BATCH]
    return [tokenizer(text)["input_ids"][:n] for text, n in zip(texts, LENGTHS)]


def corpus() -> list[str]:
    return json.loads(FILE.read_text())


def draw() -> list[str]:
    """Prose, code and lists in turn, as many of each as there are of the scarcest kind."""
    kinds = (_prose(), _code(), _lists())
    return [text for texts in zip(*kinds) for text in texts]


def _prose() -> list[str]:
    from pydoc_data.topics import topics
    found = []
    for key in sorted(topics):
        for paragraph in topics[key].split("\n\n"):
            words = paragraph.split()
            # A paragraph of sentences, not a grammar rule or an example.
            if len(words) >= WORDS and words[0][:1].isupper() and not re.search(r"::=|>>>|[{}]", paragraph):
                found.append(" ".join(words[:WORDS]))
                break
    return found


def _code() -> list[str]:
    import json.decoder
    import textwrap
    import shlex
    import string
    import fractions
    found = []
    for module in (textwrap, shlex, string, fractions, json.decoder):
        for _, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module.__name__:
                lines = inspect.getsource(function).splitlines()
                found.append("\n".join(lines[:12]))
    return found


def _lists() -> list[str]:
    """Eight code points in a row, each with its name, from blocks 0x1000 apart: Latin, Greek, arrows, CJK, symbols."""
    found = []
    for start in range(0x0100, 0x20000, 0x1000):
        chars = [chr(c) for c in range(start, start + 0x100) if unicodedata.name(chr(c), "")][:8]
        if len(chars) == 8 and "IDEOGRAPH" not in unicodedata.name(chars[0]):  # not numbered names
            found.append(", ".join(f"{c} {unicodedata.name(c)}" for c in chars))
    return found


if __name__ == "__main__":
    if sys.argv[1:] == ["--draw"]:
        FILE.write_text(json.dumps(draw(), indent=0, ensure_ascii=False) + "\n")
    for i, text in enumerate(corpus()):
        print(i, repr(text))
