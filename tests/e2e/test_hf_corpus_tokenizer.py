"""A pretrained Hugging Face model on a plain corpus reads it with its own tokenizer (issue 11,
item 1): `model.arch=hf model.path=DIR data.format=packed` with data.tokenizer left at auto, two
CPU workers, offline. A tiny Llama folder (weights and a tokenizer, as save_pretrained writes
them) is made here; the token cache holds that tokenizer's ids, nothing is trained, the loss
falls, and model/ carries the tokenizer's files byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import make_hf_tokenizer, read_metrics, run_cli, tiny_overrides

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _texts(corpus_dir: Path) -> list[str]:
    from paratrain.data import resolve_corpus
    return list(resolve_corpus(str(corpus_dir)).documents())


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, corpus_dir) -> Path:
    """A tiny LlamaForCausalLM folder with safetensors weights and its own tokenizer."""
    folder = make_hf_tokenizer(tmp_path_factory.mktemp("hf") / "tiny-llama", _texts(corpus_dir),
                               384)
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    transformers.set_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def test_hf_model_on_a_corpus_uses_its_own_tokenizer(tmp_path, hf_model, corpus_dir):
    cache = tmp_path / "cache"
    files = {p.name: p.read_bytes() for p in hf_model.iterdir() if "token" in p.name}
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    r = run_cli(["train"] + tiny_overrides(corpus_dir, cache, **{
        "model.arch": "hf", "model.path": str(hf_model), "data.format": "packed",
        "trainer.devices": "cpu:2", "trainer.max_steps": 20, "optim.lr": 3e-3,
        "run.dir": str(tmp_path / "run")}), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert f"tokenizer: the model's own, from model.path={hf_model}" in out
    assert "tokenizer: trained" not in out and "tokenizer: training" not in out  # no BPE
    assert "data.vocab_size" not in out

    hf = transformers.AutoTokenizer.from_pretrained(hf_model, local_files_only=True)
    [prepared] = [p for p in (cache / "data").iterdir() if (p / "meta.json").is_file()]
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["tokenizer"] == "pretrained" and meta["vocab_size"] == len(hf)
    assert meta["eot_id"] == hf.eos_token_id >= 384  # its own ids, not [EOT]'s 2
    texts, seen = set(_texts(corpus_dir)), 0
    for split in ("train", "val"):
        tokens = np.fromfile(prepared / f"{split}.bin", dtype=meta["dtype"])
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
        assert (model_dir / name).read_bytes() == data, name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(hf)
    assert transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)


def test_hf_model_without_a_tokenizer_is_one_line_and_exit_2(tmp_path, hf_model, corpus_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((hf_model / "config.json").read_bytes())
    r = run_cli(["train"] + tiny_overrides(corpus_dir, tmp_path / "cache", **{
        "model.arch": "hf", "model.path": str(bare), "run.dir": str(tmp_path / "run")}),
        cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    [line] = [x for x in r.stderr.splitlines() if x.strip()]
    assert "has no tokenizer" in line and "data.tokenizer=DIR" in line
    assert not (tmp_path / "run").exists()
