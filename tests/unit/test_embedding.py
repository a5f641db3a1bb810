"""Embedding models in-process: paratrain's losses against sentence-transformers' own loss
classes on the same embeddings (slow: importing sentence-transformers takes seconds) (MultipleNegativesRankingLoss with hard negatives, its symmetric
form, CosineSimilarityLoss), the poolings, the records and the bad keys (one line each)."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.errors import ConfigError, DataError
from paratrain.runtime.validation import eval_batches
from paratrain.tasks.embedding.embedder import (cosine_loss, pool, positive_ranks, ranking_losses,
                                       retrieval_counts)
from tests.unit.test_preference import _model_folder


def _embeddings(k: int, B: int = 6, H: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return [torch.randn(B, H, generator=g, dtype=torch.float64) for _ in range(k)]


@pytest.mark.slow  # importing sentence-transformers takes seconds
@pytest.mark.parametrize("columns,symmetric", [(2, False), (3, False), (2, True)])
def test_ranking_loss_equals_sentence_transformers(columns, symmetric):
    pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    texts = _embeddings(columns)
    ours = ranking_losses(texts[0], texts[1:], 20.0, symmetric).mean()
    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    theirs = MultipleNegativesRankingLoss(None, scale=20.0, directions=directions,
                                          partition_mode="per_direction" if symmetric
                                          else "joint").compute_loss_from_embeddings(texts, None)
    assert abs(ours.item() - theirs.item()) <= 1e-6


@pytest.mark.slow
def test_cosine_loss_equals_sentence_transformers():
    pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.losses import CosineSimilarityLoss
    u, v = _embeddings(2)
    score = torch.linspace(-1, 1, 6, dtype=torch.float64)
    s, n, _ = cosine_loss((u, v), score)
    ours = s / n
    theirs = CosineSimilarityLoss(None).compute_loss_from_embeddings([u, v], score)
    assert abs(ours.item() - theirs.item()) <= 1e-6


def test_retrieval_ranks_each_positive_among_the_candidates():
    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    # positives, then hard negatives; anchor 0's positive ties a negative: still first
    docs = torch.tensor([[1.0, 0.0], [1.0, 0.1], [-1.0, -1.0],
                         [2.0, 0.0], [0.0, 3.0], [1.0, 2.0]])
    ranks = positive_ranks(anchors, docs)
    # anchor 1: cos 0.0995 to [1, 0.1], beaten by [0, 3] (1) and [1, 2] (0.894): third;
    # anchor 2: cos -1 to [-1, -1], beaten by all five others: sixth
    assert ranks.tolist() == [1, 3, 6]
    counts = retrieval_counts(ranks)
    assert counts["top1"].item() == 1 and counts["samples"] == 3.0
    assert abs(counts["rr10"].item() - (1 + 1 / 3 + 1 / 6)) < 1e-12


@pytest.mark.parametrize("n", [1, 21, 32, 37])
def test_validation_blocks_are_the_same_on_any_number_of_ranks(n):
    """Blocks of consecutive samples, each once, as many batches on every rank."""
    for dp in (1, 2, 3):
        per_rank = [eval_batches(n, dp, r, micro_batch=4, block=16) for r in range(dp)]
        assert len({len(b) for b in per_rank}) == 1
        blocks = sorted(b for rank in per_rank for b in rank if b)
        assert blocks == [list(range(s, min(s + 16, n))) for s in range(0, n, 16)]
    shares = [eval_batches(21, 2, r, micro_batch=4) for r in range(2)]
    assert [len(s) for s in shares] == [3, 3] and shares[1][-1] == [17, 19]


def test_poolings_read_only_the_real_tokens():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert pool(hidden, mask, "cls").tolist() == hidden[:, 0].tolist()
    assert pool(hidden, mask, "last").tolist() == [hidden[0, 3].tolist(), hidden[1, 1].tolist()]
    assert pool(hidden, mask, "mean")[1].tolist() == hidden[1, :2].mean(0).tolist()


def test_records_of_each_kind_and_bad_records_are_one_line():
    from paratrain.tasks.embedding.records import EmbeddingCollate, embedding_dataset, encode_embedding
    tok = lambda texts, **kw: {"input_ids": [[len(w) for w in t.split()] for t in texts]}  # noqa
    rows = [{"anchor": "a bb", "positive": "ccc", "negative": "dd e"}] * 3
    examples, note = encode_embedding(rows, tok, max_length=8, source_name="t.jsonl")
    assert examples[0] == {"anchor": [1, 2], "positive": [3], "negative": [2, 1]}
    assert note.startswith("t.jsonl: 3 triplets")
    ds = embedding_dataset(examples)
    batch = EmbeddingCollate(0)([ds[0], ds[1]])
    assert batch["columns"] == 3 and batch["input_ids"].shape == (6, 2)
    scored, _ = encode_embedding([{"text1": "a", "text2": "b c", "score": 0.5}], tok,
                                 max_length=8)
    assert scored[0]["score"] == 0.5
    with pytest.raises(DataError, match="row 1 has fields .*; data.format=embedding reads"):
        encode_embedding([{"query": "a"}], tok, max_length=8, source_name="t.jsonl")
    with pytest.raises(DataError, match="row 1 has score 'high'"):
        encode_embedding([{"text1": "a", "text2": "b", "score": "high"}], tok, max_length=8)


@pytest.mark.parametrize("override,message", [
    ("embedding.pooling=max", "embedding.pooling='max' is not one of: mean, cls, last"),
    ("embedding.scale=0", "embedding.scale=0.0 must be positive"),
    ("data.drop_last=false", "needs the same number of pairs on each: leave data.drop_last"),
])
def test_bad_embedding_keys_are_one_line(tmp_path, override, message):
    from paratrain.config import TrainConfig
    llama = _model_folder(tmp_path, "llama", model_type="llama", vocab_size=300)
    args = ["model.arch=hf", f"model.path={llama}", "data.format=embedding"]
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_yaml(None, args + [override])
    cfg = TrainConfig.from_yaml(None, args)
    assert cfg.task_spec.task.endswith("EmbeddingTask") and json.dumps(cfg.embedding.scale) == "20.0"


def test_setfit_pairs_are_drawn_from_the_labels():
    from paratrain.tasks.embedding.setfit import draw_pairs
    examples = [{"input_ids": [i], "label": i % 3} for i in range(9)]
    pairs = draw_pairs(examples, rounds=2, seed=0)
    assert len(pairs) == 2 * 2 * 9 and pairs == draw_pairs(examples, rounds=2, seed=0)
    for p in pairs:
        same = p["text1"][0] % 3 == p["text2"][0] % 3
        assert p["score"] == (1.0 if same else 0.0)
    assert sum(p["score"] for p in pairs) == 18  # one same-label pair per text and round


def test_an_empty_text_or_a_score_outside_the_cosine_range_is_one_line():
    from paratrain.tasks.embedding.records import encode_embedding
    tok = lambda texts, **kw: {"input_ids": [[len(w) for w in t.split()] for t in texts]}  # noqa
    with pytest.raises(DataError, match=r"t.jsonl: row 2 has an empty 'anchor'; every text of "
                                        "a record needs words"):
        encode_embedding([{"anchor": "a", "positive": "b"}, {"anchor": "  ", "positive": "c"}],
                         tok, max_length=8, source_name="t.jsonl")
    with pytest.raises(DataError, match=r"row 1 has an empty 'text2'"):
        encode_embedding([{"text1": "a", "text2": "", "score": 0.5}], tok, max_length=8)
    for score in (5.0, -1.5):
        with pytest.raises(DataError, match=rf"row 1 has score {score}; the loss fits the cosine "
                                            r"similarity, which lies in \[-1, 1\]"):
            encode_embedding([{"text1": "a", "text2": "b", "score": score}], tok, max_length=8)
    assert encode_embedding([{"text1": "a", "text2": "b", "score": -1}], tok,
                            max_length=8)[0][0]["score"] == -1.0


def test_cls_pooling_on_a_decoder_only_model_is_refused(tmp_path):
    from paratrain.config import TrainConfig
    from paratrain.tasks.embedding.embedder import EmbeddingTask
    llama = _model_folder(tmp_path, "llama", model_type="llama", vocab_size=300)
    bert = _model_folder(tmp_path, "bert", model_type="bert", vocab_size=300)
    args = ["model.arch=hf", "data.format=embedding", "embedding.pooling=cls"]
    with pytest.raises(ConfigError, match=r"embedding.pooling=cls on model.path=.*, a decoder-only "
                                          r"model \(llama\): its first token attends to nothing "
                                          r"after it.*use embedding.pooling=last or mean"):
        EmbeddingTask.check_model(TrainConfig.from_yaml(None, args + [f"model.path={llama}"]))
    EmbeddingTask.check_model(TrainConfig.from_yaml(None, args + [f"model.path={bert}"]))


@pytest.mark.slow  # importing sentence-transformers takes seconds
def test_cosent_equals_sentence_transformers():
    pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.losses import CoSENTLoss

    from paratrain.tasks.embedding.pair_losses import cosent_losses
    u, v = _embeddings(2)
    score = torch.tensor([0.0, 3.0, 5.0, 1.0, 3.0, 4.5], dtype=torch.float64)  # ties included
    ours = cosent_losses(u, v, score, 20.0)
    assert ours.shape == (6,) and bool((ours == ours[0]).all())  # the batch's loss, per pair
    theirs = CoSENTLoss(None, scale=20.0).compute_loss_from_embeddings([u, v], score)
    assert abs(ours[0].item() - theirs.item()) <= 1e-6
