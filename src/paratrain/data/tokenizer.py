"""Tokenizer: a thin wrapper over a HF `tokenizers.Tokenizer` and the special ids the corpus uses.

The corpus pipeline (token cache, datasets, `load_model`, `generate`) sees one interface whatever
the tokenizer is: encode / decode, `vocab_size`, and three special ids held as data: `pad_id`,
`bot_id` (starts a padded row), `eot_id` (ends every document). Three kinds:
- `bpe` and `char`, trained here on the corpus: [PAD], [BOT], [EOT] at ids 0, 1, 2;
- `pretrained`: a Hugging Face tokenizer folder (`data.tokenizer=DIR`, loaded offline by
  transformers' AutoTokenizer), whose EOS ends documents, BOS (or EOS) starts a padded row and
  pad token (or EOS) pads. Its files travel unchanged (`copy_tokenizer_files`): a folder with a
  `tokenizer_config.json` next to its tokenizer.json is pretrained, one without is ours.
All kinds are plain HF tokenizer objects, so one tokenizer.json format covers save/load and the
fast Rust batch encoder covers all.

Special tokens are never matched inside text (`encode_special_tokens`): a document that contains
the string "[EOT]" (or a pretrained tokenizer's "</s>") must round-trip as text, not smuggle a
document boundary into the stream.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ..fileio import atomic_write_path

PAD, BOT, EOT, UNK = "[PAD]", "[BOT]", "[EOT]", "[UNK]"
SPECIAL_TOKENS = (PAD, BOT, EOT)  # ids 0, 1, 2 for every kind trained here
TOKENIZER_FILE = "tokenizer.json"  # its name wherever a tokenizer is saved (model/, snapshots)
PRETRAINED_CONFIG = "tokenizer_config.json"  # next to tokenizer.json: a pretrained tokenizer
# what a tokenizer saved with save_pretrained may consist of: copied as they are, byte for byte
TOKENIZER_FILES = (TOKENIZER_FILE, PRETRAINED_CONFIG, "special_tokens_map.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    bot: int
    eot: int


OWN_SPECIAL_IDS = SpecialIds(pad=0, bot=1, eot=2)  # SPECIAL_TOKENS' ids


class Tokenizer:
    def __init__(self, hf: HFTokenizer, special: Optional[SpecialIds] = None):
        """`special`: a pretrained tokenizer's ids; None: ours, checked to be at 0, 1, 2."""
        hf.encode_special_tokens = True  # see module docstring
        hf.no_truncation()  # a tokenizer.json may carry its own; documents are cut later
        hf.no_padding()
        self._hf = hf
        if special is None:
            for want, token in enumerate(SPECIAL_TOKENS):
                got = hf.token_to_id(token)
                if got != want:
                    raise ValueError(f"tokenizer has {token} at id {got}, expected {want}")
        self._special = special or OWN_SPECIAL_IDS
        self._pretrained = special is not None

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        """Byte-level BPE: all 256 bytes are in the alphabet, so any text encodes and decodes
        exactly (no unknown tokens), whatever the training subset held."""
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizer_for("bpe")
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
        hf.pre_tokenizer = pre_tokenizer_for("char")
        hf.decoder = decoders.Fuse()
        hf.add_special_tokens(list(SPECIAL_TOKENS + (UNK,)))
        return cls(hf)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> Tuple["Tokenizer", str]:
        """A Hugging Face tokenizer folder (local files only), and a note for the log ("" when
        none, e.g. that EOS pads). Encodes exactly as the transformers tokenizer does with
        add_special_tokens=False (and special-token strings in text kept as text)."""
        from ..errors import ConfigError
        from .hf_tokenizer import eos_id, load_tokenizer
        tok, note = load_tokenizer(directory)
        if not (getattr(tok, "is_fast", False) and (Path(directory).expanduser() /
                                                    TOKENIZER_FILE).is_file()):
            raise ConfigError(f"tokenizer at {directory} has no {TOKENIZER_FILE}; a corpus needs "
                              "a fast tokenizer: load it in transformers and save_pretrained it "
                              "again so that the folder holds one")
        eot = eos_id(tok)
        bot = tok.bos_token_id if tok.bos_token_id is not None else eot
        special = SpecialIds(pad=int(tok.pad_token_id), bot=int(bot), eot=eot)
        out = cls(tok.backend_tokenizer, special)
        too_big = [i for i in (special.pad, special.bot, special.eot) if i >= out.vocab_size]
        if too_big:
            raise ConfigError(f"tokenizer at {directory} has special id(s) {too_big} outside its "
                              f"vocabulary of {out.vocab_size}; its files do not belong together")
        return out, note

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """A tokenizer.json saved here (a cache, model/, a snapshot): pretrained when a
        tokenizer_config.json lies next to it, else one of ours."""
        path = Path(path)
        if is_pretrained(path):
            return cls.from_pretrained(path.parent)[0]
        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: str | os.PathLike) -> None:
        """Atomic: a reader (another rank) sees the old file or the new one, never half.
        A pretrained tokenizer is never re-saved: its files are copied (copy_tokenizer_files)."""
        if self._pretrained:
            raise ValueError("a pretrained tokenizer travels as its files: copy_tokenizer_files")
        with atomic_write_path(Path(path)) as tmp:
            self._hf.save(str(tmp))

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
        return self._special.pad

    @property
    def bot_id(self) -> int:
        return self._special.bot

    @property
    def eot_id(self) -> int:
        return self._special.eot

    @property
    def kind(self) -> str:
        if self._pretrained:
            return "pretrained"
        return "char" if isinstance(self._hf.model, models.WordLevel) else "bpe"

    @property
    def hf(self) -> HFTokenizer:
        """The underlying HF tokenizer, for anything this wrapper does not cover."""
        return self._hf

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"


def pre_tokenizer_for(kind: str) -> pre_tokenizers.PreTokenizer:
    """How a tokenizer trained here cuts text into pre-tokens, known before it is trained (the
    token cache cuts long documents where a pre-token starts: data/units.py)."""
    if kind == "bpe":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    # char: every character (newlines included) is its own pre-token; Fuse joins them back.
    return pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")


def is_pretrained(tokenizer_path: str | os.PathLike) -> bool:
    """A tokenizer.json that belongs to a Hugging Face tokenizer folder (not one of ours)."""
    return (Path(tokenizer_path).parent / PRETRAINED_CONFIG).is_file()


def tokenizer_files(tokenizer_path: str | os.PathLike) -> Dict[str, Path]:
    """{name in a saved folder: source file} of a tokenizer: the file alone as tokenizer.json
    when it is one of ours; every tokenizer file of its folder when it is pretrained."""
    path = Path(tokenizer_path)
    if not is_pretrained(path):
        return {TOKENIZER_FILE: path}
    return {name: path.parent / name for name in TOKENIZER_FILES
            if (path.parent / name).is_file()}


def copy_tokenizer_files(tokenizer_dir: Path, folder: Path) -> None:
    """A tokenizer's files copied as they are (never re-saved: byte for byte)."""
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copyfile(Path(tokenizer_dir) / name, Path(folder) / name)


def tokenizer_files_fingerprint(tokenizer_dir: str | os.PathLike) -> str:
    """sha256 over the names and bytes of the tokenizer files in a folder: what a token cache
    built with it is keyed by (the folder may move; a changed file is a new cache)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = Path(tokenizer_dir).expanduser() / name
        if f.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()
