"""Token text against token ids through the --hf checkpoint's tokenizer: the id of a token an engine spelled
as text (OpenAI-compatible logprobs), and the check that ids an engine wrote beside their text are ids of
that tokenizer at all.

An engine spells a token by its decoded text (vLLM, SGLang, TensorRT-LLM, ollama): a token that ends
inside a UTF-8 character arrives as U+FFFD (bytes 239,191,189), whose real bytes are lost. Such a token is
never mapped (Unmappable: its sequence is left out) nor judged.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Optional

from megalign.errors import UserError

TOKEN_ID = re.compile(r"token_id:(\d+)")
REPLACEMENT = "\ufffd"
# Ids beside their text are another tokenizer's when more than this share of them spell something else: a
# few may differ by how an engine spells one token alone (a special token, a space an engine cleans up).
MOST = 0.5
ASK_IDS = ("request token ids (vLLM: return_token_ids=true or return_tokens_as_token_ids=true; SGLang: "
           "return_token_ids=true, or return_meta_info=true on chat)")


def token_ids(pieces: list[tuple[Any, Optional[list[int]]]], hf: Optional[Path], where: str) -> list[int]:
    """The id of each token: "token_id:N" as it says, else its bytes (or text) through the tokenizer."""
    spelled = [TOKEN_ID.fullmatch(t) if isinstance(t, str) else None for t, _ in pieces]
    if all(spelled):
        return [int(m.group(1)) for m in spelled]
    if hf is None:
        raise UserError(f"{where}: tokens are strings; pass --hf CHECKPOINT to map them to token ids through its "
                        f"tokenizer, or {ASK_IDS}")
    lookup = _vocabulary(hf)
    return [lookup.id_of(text, raw, f"{where}[{i}]") for i, (text, raw) in enumerate(pieces)]


def check_spelling(ids: list[int], texts: list[Any], hf: Optional[Path], where: str) -> None:
    """Ids written beside the engine's text of each token: refused when most of them spell other text under
    --hf's tokenizer. Such ids are another tokenizer's (the engine ran another model than --hf), and the
    trainer would run, and compare would judge, other tokens than the engine sampled. Without --hf, and for
    tokens spelled "token_id:N" or with U+FFFD, there is nothing to check them against."""
    if hf is None:
        return
    vocabulary = _vocabulary(hf)
    judged = [(k, t, text, vocabulary.text_of(t)) for k, (t, text) in enumerate(zip(ids, texts))
              if isinstance(text, str) and not TOKEN_ID.fullmatch(text) and REPLACEMENT not in text]
    judged = [j for j in judged if j[3] is None or REPLACEMENT not in j[3]]  # a partial character spells nothing
    wrong = [j for j in judged if j[3] is None or j[3].strip() != j[2].strip()]
    if judged and len(wrong) > MOST * len(judged):
        k, t, text, own = wrong[0]
        said = "outside its vocabulary" if own is None else f"{own!r}"
        raise UserError(f"{where}: another model's tokenizer: {len(wrong)} of {len(judged)} token ids do not spell "
                        f"the engine's text of their token under --hf {hf}'s tokenizer (the first, [{k}]: id {t} is "
                        f"{said}, the engine's text {text!r}): the engine ran another model than --hf, or the ids "
                        "are another tokenizer's")


class Unmappable(Exception):
    """A token whose id its spelling does not tell: its sequence is left out (LeftOut), never guessed."""


@functools.lru_cache(maxsize=2)  # loading a tokenizer takes a second: one per checkpoint and process
def _vocabulary(hf: Path) -> "_Vocabulary":
    return _Vocabulary(hf)


class _Vocabulary:
    """A tokenizer's token -> id map, with byte-level BPE's spelling of bytes (GPT-2's bytes_to_unicode),
    so that a token's exact bytes find its id without re-tokenising text; and each id's text alone."""

    def __init__(self, hf: Path):
        from transformers import AutoTokenizer
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(hf))
        except (OSError, ValueError) as e:
            raise UserError(f"--hf {hf}: no tokenizer there ({e})") from None
        self.vocab = self.tokenizer.get_vocab()
        self.spelling = bytes_to_unicode()

    @functools.cached_property
    def texts(self) -> list[str]:
        """Each id's text decoded alone, as an engine spells a token: all at once (a file holds millions of
        tokens, a vocabulary some 10^5)."""
        return self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))], skip_special_tokens=False,
                                           clean_up_tokenization_spaces=False)

    def text_of(self, token: int) -> Optional[str]:
        """None for an id outside the vocabulary."""
        return self.texts[token] if 0 <= token < len(self.texts) else None

    def id_of(self, text: Any, raw: Optional[list[int]], where: str) -> int:
        data = bytes(raw) if isinstance(raw, list) else str(text).encode("utf-8")
        if REPLACEMENT.encode("utf-8") in data:
            # the engine decoded a token that ends inside a UTF-8 character: its own bytes are lost, and
            # the tokenizer's own U+FFFD token (or any other) would be a guess
            raise Unmappable(f"{where}: token {text!r} is spelled with U+FFFD (bytes 239,191,189), the engine's "
                             f"decoded text of a partial UTF-8 character, so its id is unknown: {ASK_IDS}")
        spelled = "".join(self.spelling[b] for b in data)
        for candidate in (spelled, str(text)):
            if candidate in self.vocab:
                return self.vocab[candidate]
        alone = self.tokenizer.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False)
        if len(alone) != 1:
            raise UserError(f"{where}: token {text!r} is not one token of the --hf tokenizer (the rollout is "
                            "another model's, or --hf is not the engine's checkpoint)")
        return alone[0]
