"""Embedding models end to end (data.format=embedding, a tiny local Llama, mean pooling, anchor /
positive / hard-negative records): 1 worker and 2 DDP workers with the same global batch run
the same steps and end with the same weights (the candidates gathered from both workers with
their gradients); validation reports retrieval figures; the run's model/ folder loads with
sentence-transformers and embeds texts as paratrain does, and `paratrain generate` prints the
same embedding."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import read_metrics, read_summary, run_cli
from tests.e2e._preference_data import preference_rows, small_run_args
from tests.e2e._tiny_model import write_jsonl

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900)]


def _records(n: int, seed: int) -> list[dict]:
    return [{"anchor": r["prompt"], "positive": r["chosen"], "negative": r["rejected"]}
            for r in preference_rows(n, seed)]


def _train(run_dir: Path, llama: Path, train: Path, val: Path, **extra) -> Path:
    r = run_cli(small_run_args(llama, train, val, run_dir, **{
        "data.format": "embedding", "trainer.max_steps": 5, **extra}), cwd=run_dir.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_one_and_two_workers_agree_and_sentence_transformers_loads_the_model(
        tmp_path, preference_llama):
    from safetensors.torch import load_file
    train = write_jsonl(tmp_path / "train.jsonl", _records(96, 0))
    val = write_jsonl(tmp_path / "val.jsonl", _records(21, 1))
    one = _train(tmp_path / "one", preference_llama, train, val,
                 **{"trainer.devices": "cpu", "trainer.batch_size": 8})
    two = _train(tmp_path / "two", preference_llama, train, val, **{"trainer.strategy": "ddp"})
    rows = [read_metrics(one), read_metrics(two)]
    assert len(rows[0]) == len(rows[1]) == 5
    for a, b in zip(*rows):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    w1, w2 = (load_file(str(run / "model" / "model.safetensors")) for run in (one, two))
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-5
    summary = read_summary(one)
    assert 0 <= summary["val_accuracy"] <= 1 and summary["val_accuracy"] <= summary["val_mrr@10"]

    texts = [r["anchor"] for r in _records(5, 2)]
    ours = _paratrain_embeddings(one / "model", texts)
    st = pytest.importorskip("sentence_transformers")
    theirs = st.SentenceTransformer(str(one / "model"), device="cpu").encode(
        texts, convert_to_tensor=True, batch_size=2)
    assert (ours - theirs).abs().max().item() <= 1e-5
    from paratrain.tasks.embedding import generate_embedding
    printed = generate_embedding(one / "model", texts[0], SimpleNamespace(device="cpu",
                                                                          run_dir=one))
    assert torch.allclose(torch.tensor(eval(printed)), ours[0], atol=1e-5)


def _paratrain_embeddings(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """The texts embedded the way training embedded them: paratrain's encoder, collate, pooling."""
    import transformers

    from paratrain.data.embedding import EmbeddingCollate, embedding_dataset, encode_embedding
    from paratrain.data.hf_tokenizer import load_tokenizer
    from paratrain.tasks.embedding import pool
    tok, _ = load_tokenizer(model_dir)
    rows = [{"anchor": t, "positive": t} for t in texts]
    ds = embedding_dataset(encode_embedding(rows, tok, max_length=64)[0])
    batch = EmbeddingCollate(tok.pad_token_id)([ds[i] for i in range(len(texts))])
    model = transformers.AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.no_grad():
        hidden = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).last_hidden_state
    return pool(hidden, batch["attention_mask"], "mean")[:len(texts)]
