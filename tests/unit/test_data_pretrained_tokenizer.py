"""A pretrained tokenizer folder (data.tokenizer=DIR) for a corpus: the same Tokenizer interface
with the folder's own special ids, a token cache keyed by the folder's bytes, and its files
carried unchanged into the cache, model/ and snapshots."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from paratrain.config import DataConfig, TrainConfig
from paratrain.data import Tokenizer, data_fingerprint, prepare_data, resolve_corpus
from paratrain.data.tokenizer import TOKENIZER_FILE, is_pretrained, tokenizer_files
from paratrain.errors import ConfigError
from paratrain.models import files as model_io
from tests.conftest import make_hf_tokenizer
from tests.unit.test_data_cache import make_corpus, quiet

transformers = pytest.importorskip("transformers")

TEXTS = [f"def function_{i}(x):\n    return x * {i} + len('héllo {i}')\n" * 3 for i in range(60)]


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    return make_hf_tokenizer(tmp_path_factory.mktemp("tok") / "llama_like", TEXTS, 300)


@pytest.fixture(scope="module")
def gpt2_like(tmp_path_factory):
    return make_hf_tokenizer(tmp_path_factory.mktemp("tok") / "gpt2_like", TEXTS, 300, bos=False)


def _hf(folder):
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


def test_special_ids_are_the_folders_own(llama_like, gpt2_like):
    tok, note = Tokenizer.from_pretrained(llama_like)
    hf = _hf(llama_like)
    assert tok.kind == "pretrained" and tok.vocab_size == len(hf)
    assert (tok.bot_id, tok.eot_id) == (hf.bos_token_id, hf.eos_token_id)
    assert tok.eot_id >= 300 and tok.pad_id == tok.eot_id  # no pad token: EOS pads, and says so
    assert "no pad token" in note
    tok2, _ = Tokenizer.from_pretrained(gpt2_like)  # EOS alone: it starts rows too
    assert tok2.bot_id == tok2.eot_id == tok2.pad_id == _hf(gpt2_like).eos_token_id


def test_pad_token_is_used_when_there_is_one(tmp_path):
    folder = make_hf_tokenizer(tmp_path / "t", TEXTS, 300, pad=True)
    tok, note = Tokenizer.from_pretrained(folder)
    assert tok.pad_id == _hf(folder).pad_token_id != tok.eot_id and note == ""


def test_encodes_like_transformers_and_keeps_special_strings_as_text(llama_like):
    tok, _ = Tokenizer.from_pretrained(llama_like)
    hf = _hf(llama_like)
    for text in TEXTS[:5] + ["∑ ≠ 😀\t", ""]:
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(TEXTS[:5]) == [tok.encode(t) for t in TEXTS[:5]]
    ids = tok.encode("a </s> b")  # a document cannot smuggle in a boundary
    assert tok.eot_id not in ids and tok.decode(ids) == "a </s> b"


def test_load_tells_a_pretrained_tokenizer_json_from_ours(llama_like, tmp_path):
    assert is_pretrained(llama_like / TOKENIZER_FILE)
    assert Tokenizer.load(llama_like / TOKENIZER_FILE).kind == "pretrained"
    ours = tmp_path / "tokenizer.json"
    Tokenizer.train_bpe(TEXTS, 300).save(ours)
    assert not is_pretrained(ours) and Tokenizer.load(ours).eot_id == 2
    assert tokenizer_files(ours) == {TOKENIZER_FILE: ours}
    assert set(tokenizer_files(llama_like / TOKENIZER_FILE)) == {p.name for p in
                                                                 llama_like.iterdir()}


def test_without_eos_or_tokenizer_json_is_one_config_error(tmp_path, llama_like):
    no_eos = tmp_path / "no_eos"
    shutil.copytree(llama_like, no_eos)
    cfg = json.loads((no_eos / "tokenizer_config.json").read_text())
    cfg.pop("eos_token")
    (no_eos / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no EOS token|neither a pad token nor an EOS"):
        Tokenizer.from_pretrained(no_eos)
    with pytest.raises(ConfigError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "missing")


def test_cache_holds_the_tokenizers_ids_and_its_files(tmp_path, llama_like):
    src = make_corpus(tmp_path / "src")
    cfg = DataConfig(source=str(src), tokenizer=str(llama_like), val_fraction=0.1)
    p = prepare_data(cfg, tmp_path / "cache", log=quiet)
    hf = _hf(llama_like)
    m = p.meta
    assert m["tokenizer"] == "pretrained" and m["vocab_size"] == len(hf) == p.vocab_size
    assert (m["eot_id"], m["bot_id"], m["pad_id"]) == (hf.eos_token_id, hf.bos_token_id,
                                                        hf.eos_token_id)
    for f in llama_like.iterdir():  # byte for byte
        assert (p.tokenizer_path.parent / f.name).read_bytes() == f.read_bytes()
    assert p.tokenizer().kind == "pretrained"
    docs = {}
    for split in ("train", "val"):
        tokens = p.tokens(split)[:]
        offsets = np.load(p.offsets_path(split))
        for a, b in zip(offsets[:-1], offsets[1:]):
            assert tokens[b - 1] == hf.eos_token_id
            docs[hf.decode(tokens[a:b - 1].tolist())] = tokens[a:b - 1].tolist()
    texts = list(resolve_corpus(str(src)).documents())
    assert sorted(docs) == sorted(texts)
    for text in texts:
        assert docs[text] == hf(text, add_special_tokens=False)["input_ids"]


def test_fingerprint_follows_the_tokenizers_bytes_not_its_path(tmp_path, llama_like):
    src = make_corpus(tmp_path / "src")
    corpus = resolve_corpus(str(src))
    fp = data_fingerprint(DataConfig(source=str(src), tokenizer=str(llama_like)), corpus)
    moved = shutil.copytree(llama_like, tmp_path / "moved")
    assert data_fingerprint(DataConfig(source=str(src), tokenizer=str(moved)), corpus) == fp
    assert data_fingerprint(DataConfig(source=str(src), tokenizer=str(moved), vocab_size=999),
                            corpus) == fp  # data.vocab_size is for a trained BPE only
    cfg = json.loads((moved / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<s>"
    (moved / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert data_fingerprint(DataConfig(source=str(src), tokenizer=str(moved)), corpus) != fp
    other = make_hf_tokenizer(tmp_path / "other", TEXTS[:30], 280)
    assert data_fingerprint(DataConfig(source=str(src), tokenizer=str(other)), corpus) != fp
    assert data_fingerprint(DataConfig(source=str(src)), corpus) != fp


def test_model_folder_carries_the_files_and_loads_with_them(tmp_path, llama_like):
    import torch

    from paratrain.config import ModelConfig
    from paratrain.models import build_model
    from paratrain.config.presets import resolve_model_config
    tok, _ = Tokenizer.from_pretrained(llama_like)
    args = resolve_model_config(ModelConfig(preset="tiny"), vocab_size=tok.vocab_size,
                                seq_length=16)
    torch.manual_seed(0)
    model_io.save_model(tmp_path / "model", build_model(args).state_dict(), args.to_dict(),
                        llama_like / TOKENIZER_FILE)
    for f in llama_like.iterdir():
        assert (tmp_path / "model" / f.name).read_bytes() == f.read_bytes()
    _, loaded = model_io.load_model(tmp_path / "model")
    assert loaded.kind == "pretrained" and loaded.eot_id == tok.eot_id
    assert loaded.encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_config_accepts_a_tokenizer_folder_for_a_corpus(tmp_path, llama_like):
    for fmt in ("packed", "padded"):
        cfg = TrainConfig.from_yaml(None, [f"data.tokenizer={llama_like}", f"data.format={fmt}"])
        assert cfg.data.tokenizer == str(llama_like)
    with pytest.raises(ConfigError, match="is not one of: auto, bpe, char, or a directory"):
        TrainConfig.from_yaml(None, [f"data.tokenizer={tmp_path / 'nope'}"])


def _hf_model_dir(folder, tokenizer=None, vocab_size=512, weights=False):
    """A tiny Llama folder as save_pretrained writes it: config.json, optionally weights and a
    tokenizer's files."""
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64)
    if weights:
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    if tokenizer is not None:
        for f in tokenizer.iterdir():
            shutil.copyfile(f, folder / f.name)
    return folder


def test_auto_is_the_hf_models_own_tokenizer_on_a_corpus(tmp_path, llama_like):
    model = _hf_model_dir(tmp_path / "model", llama_like)
    hf = ["model.arch=hf", f"model.path={model}"]
    corpus = resolve_corpus(str(make_corpus(tmp_path / "corpus")))
    for fmt in ("packed", "padded"):
        cfg = TrainConfig.from_yaml(None, hf + [f"data.format={fmt}"])
        assert cfg.data.tokenizer == "auto" and cfg.corpus_data.tokenizer == str(model)
        # the same cache as naming a copy of the tokenizer: keyed by its files' bytes
        assert data_fingerprint(cfg.corpus_data, corpus) == data_fingerprint(
            DataConfig(tokenizer=str(llama_like)), corpus)
    scratch = TrainConfig.from_yaml(None, ["data.vocab_size=300"])  # a model from scratch: bpe
    assert scratch.corpus_data.tokenizer == "bpe"
    assert data_fingerprint(scratch.corpus_data, corpus) == data_fingerprint(
        DataConfig(tokenizer="bpe", vocab_size=300), corpus) == data_fingerprint(
        DataConfig(vocab_size=300), corpus)  # a DataConfig alone reads auto as bpe
    other = TrainConfig.from_yaml(None, hf + [f"data.tokenizer={tmp_path / 'model'}"])
    assert other.corpus_data.tokenizer == str(model)


def test_hf_model_without_a_tokenizer_and_a_bpe_that_does_not_fit_are_one_line(tmp_path):
    bare = _hf_model_dir(tmp_path / "bare", vocab_size=384)
    with pytest.raises(ConfigError, match=r"has no tokenizer .*pass data.tokenizer=DIR.*"
                                          r"or data.tokenizer=bpe") as e:
        TrainConfig.from_yaml(None, ["model.arch=hf", f"model.path={bare}"])
    assert "\n" not in str(e.value)
    weighted = _hf_model_dir(tmp_path / "weighted", vocab_size=384, weights=True)
    with pytest.raises(ConfigError, match="has no tokenizer") as e:
        TrainConfig.from_yaml(None, ["model.arch=hf", f"model.path={weighted}"])
    assert "data.tokenizer=bpe" not in str(e.value)  # its weights would be lost on new ids
    ok = TrainConfig.from_yaml(None, ["model.arch=hf", f"model.path={bare}", "data.tokenizer=bpe",
                                      "data.vocab_size=384"])
    assert ok.corpus_data.tokenizer == "bpe"
    with pytest.raises(ConfigError, match=r"data.vocab_size=4096, more than model.path's "
                                          r"embeddings hold \(vocab_size=384"):
        TrainConfig.from_yaml(None, ["model.arch=hf", f"model.path={bare}", "data.tokenizer=bpe"])
    for kind in ("bpe", "char"):  # fine-tuning formats read the pretrained model's own ids
        with pytest.raises(ConfigError, match=f"data.tokenizer='{kind}' trains a new tokenizer"):
            TrainConfig.from_yaml(None, ["model.arch=hf", f"model.path={bare}",
                                         "data.format=pairs", f"data.tokenizer={kind}"])
