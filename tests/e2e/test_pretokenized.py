"""A folder of token shards written elsewhere (nanoGPT-style: flat ids, EOS between documents,
meta.json) trains on directly, with the same losses as the same text tokenized here."""

import json
import shutil

import numpy as np
import pytest

from paratrain.data import prepare_data
from paratrain.config import DataConfig
from paratrain.errors import DataError
from tests._runs import ONE_WORKER, tiny_run, trained_run
from tests.conftest import tiny_overrides


def _nanogpt_folder(prepared, out):
    """What a preparation script would write: one flat file per split, and what the ids are."""
    out.mkdir()
    for split in ("train", "val"):
        prepared.tokens(split)[:].tofile(out / f"{split}.bin")
    (out / "meta.json").write_text(json.dumps({"vocab_size": prepared.vocab_size,
                                               "eos_id": prepared.meta["eot_id"]}))
    shutil.copy(prepared.tokenizer_path, out / "tokenizer.json")
    return out


@pytest.mark.slow
def test_pretokenized_shards_train_the_same_losses(tmp_path_factory, corpus_dir, cache_dir):
    ref = tiny_run(tmp_path_factory, corpus_dir, cache_dir, **ONE_WORKER)
    prepared = prepare_data(DataConfig(source=str(corpus_dir), vocab_size=384), cache_dir,
                            log=lambda m: None)  # the reference's cache, reused
    folder = _nanogpt_folder(prepared, tmp_path_factory.mktemp("tokens") / "shards")
    over = dict(o.split("=", 1) for o in tiny_overrides(corpus_dir, cache_dir, **ONE_WORKER))
    run = trained_run(tmp_path_factory, {**over, "data.source": str(folder)})
    assert "is tokenized already" in run.stdout + run.stderr

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()
                if "loss" in json.loads(line)]
    assert losses(run.dir) == losses(ref.dir) and len(losses(ref.dir)) == 10
    summary = [json.loads((d / "summary.json").read_text()) for d in (ref.dir, run.dir)]
    assert summary[0]["val_loss"] == summary[1]["val_loss"] is not None
    assert (run.dir / "model" / "tokenizer.json").is_file()


def test_a_token_folder_must_say_what_its_ids_are(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    np.arange(10, dtype=np.uint16).tofile(folder / "train.bin")
    (folder / "meta.pkl").write_bytes(b"not read")
    cfg = DataConfig(source=str(folder))
    with pytest.raises(DataError, match=r"no meta.json \(nanoGPT's meta.pkl is not read.*"
                                        r'write meta.json next to them: \{"vocab_size": N'):
        prepare_data(cfg, tmp_path / "c")
    (folder / "meta.json").write_text('{"vocab_size": 300, "eos_id": 0}')
    with pytest.raises(DataError, match="padded rows need each document's start"):
        prepare_data(cfg, tmp_path / "c", packed=False)
    (folder / "val.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="val.bin is 3 bytes, not a whole number of uint16"):
        prepare_data(cfg, tmp_path / "c")
    (folder / "val.bin").write_bytes(b"\x01\x00\x02\x00")
    p = prepare_data(cfg, tmp_path / "c", log=lambda m: None)
    assert p.tokens("train")[:].tolist() == list(range(10)) and p.tokens("val")[:].tolist() == [1, 2]
    assert p.tokenizer_path is None and p.num_docs("train") is None
    (folder / "meta.json").unlink()
    (folder / "notes.txt").write_text("a stray .bin in a folder of text leaves it text")
    assert prepare_data(cfg, tmp_path / "c", log=lambda m: None).meta["kind"] == "text"


def test_a_bad_dtype_or_an_id_beyond_the_vocabulary_is_one_line_before_any_worker(tmp_path):
    """meta.json's "dtype" is uint16 or uint32 (numpy would take "float32", and "uint12" was a
    traceback); an id at or over vocab_size is named with its file before training (it was an
    IndexError in a worker); the CLI exits 2 with that line."""
    from tests.conftest import run_cli
    folder = tmp_path / "shards"
    folder.mkdir()
    np.array([1, 2, 0, 3, 299, 0], dtype=np.uint16).tofile(folder / "train.bin")
    np.array([1, 2, 0], dtype=np.uint16).tofile(folder / "val.bin")
    cfg = DataConfig(source=str(folder))
    for dtype in ("uint12", "float32", "int8"):
        (folder / "meta.json").write_text(json.dumps({"vocab_size": 300, "eos_id": 0,
                                                      "dtype": dtype}))
        with pytest.raises(DataError, match=f'"dtype": {dtype!r}; token ids are one of '
                                            "uint16, uint32"):
            prepare_data(cfg, tmp_path / "c")
    (folder / "meta.json").write_text('{"vocab_size": 70000, "eos_id": 0, "dtype": "uint16"}')
    with pytest.raises(DataError, match='vocab_size 70000 needs ids over 65,535'):
        prepare_data(cfg, tmp_path / "c")
    (folder / "meta.json").write_text('{"vocab_size": 299, "eos_id": 0}')
    with pytest.raises(DataError, match=r"train.bin holds token id 299, beyond meta.json's "
                                        r"vocab_size 299 \(ids are 0 to 298\); set vocab_size "
                                        "to at least 300"):
        prepare_data(cfg, tmp_path / "c", log=lambda m: None)
    with pytest.raises(DataError, match="train.bin holds token id 299"):  # from the note
        prepare_data(cfg, tmp_path / "c", log=lambda m: None)
    (folder / "meta.json").write_text('{"vocab_size": 300, "eos_id": 0, "dtype": "uint12"}')
    r = run_cli(["train", f"data.source={folder}", f"data.cache_dir={tmp_path / 'c'}",
                 "trainer.devices=cpu:2", f"run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "token ids are one of uint16, uint32" in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()
