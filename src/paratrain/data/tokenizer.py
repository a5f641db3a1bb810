"""Tokenizer: a thin wrapper over a HF `tokenizers.Tokenizer` with our three special tokens.

Both kinds (byte-level BPE and char-level) are plain HF tokenizer objects, so one tokenizer.json
format covers save/load and the fast Rust batch encoder covers both.

Special tokens are never matched inside text (`encode_special_tokens`): a document that contains
the string "[EOT]" must round-trip as text, not smuggle a document boundary into the stream.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable, List, Sequence

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

PAD, BOT, EOT, UNK = "[PAD]", "[BOT]", "[EOT]", "[UNK]"
SPECIAL_TOKENS = (PAD, BOT, EOT)  # ids 0, 1, 2 for every kind
TOKENIZER_FILE = "tokenizer.json"  # its name wherever a tokenizer is saved (model/, snapshots)


class Tokenizer:
    def __init__(self, hf: HFTokenizer):
        hf.encode_special_tokens = True  # see module docstring
        self._hf = hf
        for want, token in enumerate(SPECIAL_TOKENS):
            got = hf.token_to_id(token)
            if got != want:
                raise ValueError(f"tokenizer has {token} at id {got}, expected {want}")

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        """Byte-level BPE: all 256 bytes are in the alphabet, so any text encodes and decodes
        exactly (no unknown tokens), whatever the training subset held."""
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=2, show_progress=False,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)

    @classmethod
    def train_char(cls, texts: Iterable[str]) -> "Tokenizer":
        """One token per distinct character seen (sorted, so the vocab does not depend on the
        order of documents); unseen characters become [UNK] (id 3)."""
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + (UNK,))}
        for ch in sorted(chars):
            vocab.setdefault(ch, len(vocab))  # a character spelling a special token cannot occur
        hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
        # Every character (newlines included) is its own pre-token; Fuse joins them back.
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        hf.decoder = decoders.Fuse()
        hf.add_special_tokens(list(SPECIAL_TOKENS + (UNK,)))
        return cls(hf)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: str | os.PathLike) -> None:
        """Atomic: a reader (another rank) sees the old file or the new one, never half."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            self._hf.save(tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    # ---- use -------------------------------------------------------------------------------
    def encode(self, text: str) -> List[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Parallel across documents in Rust (the GIL is released)."""
        encodings = self._hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bot_id(self) -> int:
        return 1

    @property
    def eot_id(self) -> int:
        return 2

    @property
    def kind(self) -> str:
        return "char" if isinstance(self._hf.model, models.WordLevel) else "bpe"

    @property
    def hf(self) -> HFTokenizer:
        """The underlying HF tokenizer, for anything this wrapper does not cover."""
        return self._hf

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"
