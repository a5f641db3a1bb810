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
