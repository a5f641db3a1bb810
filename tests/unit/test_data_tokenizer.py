"""Tokenizers: exact round trips, special ids, requested vocab size, save/load identity."""

import pytest

from paratrain.data import Tokenizer

CODE = '''
import os


class Greeter:
    """Says hello in a few languages: héllo, 你好, привет, 👋."""

    def __init__(self, name: str) -> None:
        self.name = name

    def greet(self) -> str:
        return f"Hello, {self.name}!\\t[EOT] is just text here"
'''
TEXTS = [CODE.replace("Greeter", f"Greeter{i}").replace("name", f"name_{i % 7}")
         for i in range(300)]


@pytest.fixture(scope="module")
def bpe():
    return Tokenizer.train_bpe(TEXTS, vocab_size=400)


def test_bpe_vocab_and_special_ids(bpe):
    assert bpe.vocab_size == 400
    assert (bpe.pad_id, bpe.bot_id, bpe.eot_id) == (0, 1, 2)
    assert bpe.hf.id_to_token(2) == "[EOT]"


@pytest.mark.parametrize("text", [CODE, "def f():\r\n\treturn '∑ ≠ 😀'  # unseen chars\n",
                                  "", " leading space", "\x00\x7f binary-ish"])
def test_bpe_round_trip_is_exact(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert all(0 <= i < bpe.vocab_size for i in ids)


def test_special_token_strings_in_text_stay_text(bpe):
    ids = bpe.encode("[EOT][PAD]")
    assert not {0, 1, 2} & set(ids)
    assert bpe.decode(ids) == "[EOT][PAD]"


def test_bpe_compresses(bpe):
    assert len(bpe.encode(CODE)) < len(CODE.encode()) / 2


def test_encode_batch_matches_encode(bpe):
    texts = TEXTS[:5] + ["x", ""]
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]


def test_save_load_identity(bpe, tmp_path):
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp file left
    loaded = Tokenizer.load(path)
    assert loaded.vocab_size == bpe.vocab_size and loaded.kind == "bpe"
    assert loaded.encode(CODE) == bpe.encode(CODE)
    assert loaded.encode("[EOT]") == bpe.encode("[EOT]")


def test_char_tokenizer(tmp_path):
    tok = Tokenizer.train_char(["hello\n", "wörld 👋\t"])
    assert (tok.pad_id, tok.bot_id, tok.eot_id) == (0, 1, 2)
    assert tok.vocab_size == 4 + len(set("hello\nwörld 👋\t"))
    text = "world\nhello 👋\t"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.encode("hq") == [tok.encode("h")[0], 3]  # unseen -> [UNK]
    tok.save(tmp_path / "t.json")
    loaded = Tokenizer.load(tmp_path / "t.json")
    assert loaded.kind == "char" and loaded.encode(text) == ids
    assert loaded.encode_batch([text, "oh"]) == [ids, tok.encode("oh")]
