"""Sentence-embedding objectives (data.format=embedding, trainer.objective=setfit on classify
records: tasks/embedding/): the `embedding` section, its keys (one docstring each, as in
sections.py), the poolings it accepts and its checks, torch-free. tree.py joins the section into
`TrainConfig`; config/registry.py names the check in the embedding tasks' specs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError


@dataclass
class EmbeddingConfig:
    """Sentence-embedding models (data.format=embedding); see tasks/embedding/embedder.py."""
    pooling: str = "mean"
    """mean | cls | last (the last real token: decoder models)."""
    scale: float = 20.0
    """Similarities x scale are the logits of the in-batch-negatives loss."""
    symmetric: bool = False
    """Also score each positive against every anchor (sentence-transformers'
    MultipleNegativesSymmetricRankingLoss)."""
    normalize: bool = False
    """Save the model with a Normalize module (unit-length embeddings)."""
    pair_loss: str = "cosine"
    """The loss of scored pairs (text1 / text2 / score; SetFit's pairs): cosine
    (CosineSimilarityLoss, (cos - score)^2: scores in [-1, 1]) | cosent (CoSENT: the pairs
    ordered by cosine as by score, over the whole global batch, embedding.scale its scale:
    scores on any scale)."""
    pair_iterations: int = 20
    """trainer.objective=setfit: rounds of pairs drawn per text (one same-label, one other)."""


# what embedding.pooling accepts, each with the key of sentence-transformers' Pooling config
# that says it (tasks/embedding/embedder.py's POOL computes each one)
POOLINGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
            "last": "pooling_mode_lasttoken"}


# embedding.pair_loss: tasks/embedding/embedder.py computes each one
PAIR_LOSSES = ("cosine", "cosent")


def check_embedding(cfg: Any) -> None:
    """embedding.*: a known pooling and pair loss, and a positive scale."""
    e = cfg.embedding
    if e.pair_loss not in PAIR_LOSSES:
        raise ConfigError(f"embedding.pair_loss={e.pair_loss!r} is not one of: "
                          f"{', '.join(PAIR_LOSSES)}")
    if e.pooling not in POOLINGS:
        raise ConfigError(f"embedding.pooling={e.pooling!r} is not one of: "
                          f"{', '.join(POOLINGS)} (last: for decoder-only models)")
    if e.pair_iterations < 1:
        raise ConfigError(f"embedding.pair_iterations={e.pair_iterations} must be at least 1 "
                          "(SetFit's default: 20)")
    if not e.scale > 0:
        raise ConfigError(f"embedding.scale={e.scale} must be positive (sentence-transformers' "
                          "default: 20, a temperature of 0.05)")
    if cfg.data.format == "embedding" and not cfg.data.drop_last:
        raise ConfigError("data.format=embedding gathers the in-batch negatives from every "
                          "worker, which needs the same number of pairs on each: leave "
                          "data.drop_last=true (a short last batch is dropped)")
