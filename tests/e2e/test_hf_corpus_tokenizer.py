"""A pretrained Hugging Face model on a plain corpus reads it with its own tokenizer (issue 11,
item 1): `model.arch=hf model.path=DIR data.format=packed` with data.tokenizer left at auto, two
CPU workers, offline. A tiny Llama folder (weights and a tokenizer, as save_pretrained writes
them: conftest's `hf_llama`) is made here; the token cache holds that tokenizer's ids, nothing is
trained, the loss falls, and model/ carries the tokenizer's files (byte for byte but for the class
name in tokenizer_config.json, made portable)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paratrain.data import load_prepared
from tests.conftest import cli_error, corpus_texts, read_metrics, run_cli, tiny_overrides

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_hf_model_on_a_corpus_uses_its_own_tokenizer(tmp_path, hf_llama, corpus_dir):
    cache = tmp_path / "cache"
    files = {p.name: p.read_bytes() for p in hf_llama.iterdir() if "token" in p.name}
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    r = run_cli(["train"] + tiny_overrides(corpus_dir, cache, **{
        "model.arch": "hf", "model.path": str(hf_llama), "data.format": "packed",
        "trainer.devices": "cpu:2", "trainer.max_steps": 20, "optim.lr": 3e-3,
        "run.dir": str(tmp_path / "run")}), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert f"tokenizer: the model's own, from model.path={hf_llama}" in out
    assert "tokenizer: trained" not in out and "tokenizer: training" not in out  # no BPE
    assert "data.vocab_size" not in out

    hf = transformers.AutoTokenizer.from_pretrained(hf_llama, local_files_only=True)
    [prepared] = [p for p in (cache / "data").iterdir() if (p / "meta.json").is_file()]
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["tokenizer"] == "pretrained" and meta["vocab_size"] == len(hf)
    assert meta["eot_id"] == hf.eos_token_id >= 384  # its own ids, not [EOT]'s 2
    texts, seen = set(corpus_texts(corpus_dir)), 0
    for split in ("train", "val"):
        tokens = load_prepared(prepared).tokens(split)[:]
        offsets = np.load(prepared / f"{split}_offsets.npy")
        for a, b in zip(offsets[:-1], offsets[1:]):
            ids = tokens[a:b].tolist()
            text = hf.decode(ids[:-1])
            assert ids[-1] == hf.eos_token_id and text in texts
            assert ids[:-1] == hf(text, add_special_tokens=False)["input_ids"]
            seen += 1
    assert seen == len(texts)

    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert len(losses) == 20 and all(np.isfinite(losses))
    assert sum(losses[-5:]) < sum(losses[:5]) - 0.5, losses
    model_dir = tmp_path / "run" / "model"
    for name, data in files.items():
        if name != "tokenizer_config.json":
            assert (model_dir / name).read_bytes() == data, name
    # tokenizer_config.json: the same settings, the class under the name transformers 4.x reads
    # too (models.hf.portable_tokenizer_config)
    ours, theirs = (json.loads(t) for t in ((model_dir / "tokenizer_config.json").read_text(),
                                            files["tokenizer_config.json"]))
    assert ours.pop("tokenizer_class") == "PreTrainedTokenizerFast"
    assert theirs.pop("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert ours == theirs
    again = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    sample = sorted(texts)[0]
    assert again(sample)["input_ids"] == hf(sample)["input_ids"]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(hf)
    assert transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)


def test_hf_model_without_a_tokenizer_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys,
                                                              hf_llama, corpus_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((hf_llama / "config.json").read_bytes())
    monkeypatch.chdir(tmp_path)  # in this process: the entry point's exit code is test_errors'
    line = cli_error(capsys, ["train"] + tiny_overrides(corpus_dir, tmp_path / "cache", **{
        "model.arch": "hf", "model.path": str(bare), "run.dir": str(tmp_path / "run")}),
        only_line=True)
    assert "has no tokenizer" in line and "data.tokenizer=DIR" in line
    assert not (tmp_path / "run").exists()
