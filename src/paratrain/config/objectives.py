"""The sections of single objectives (dpo, kto, embedding; rl has rl.py): their keys, one
docstring each, as in sections.py. tree.py joins them into `TrainConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DPOConfig:
    """Direct preference optimization (trainer.objective=dpo); see tasks/preference/dpo.py."""
    beta: float = 0.1
    """How far the policy may move from the reference."""
    loss: str = "sigmoid"
    """sigmoid (the DPO paper) | ipo (TRL's: log-probs averaged per token) | ipo_sum (summed
    log-probs) | hinge."""
    label_smoothing: float = 0.0
    """sigmoid: the assumed share of flipped labels (cDPO)."""
    reference: Optional[str] = None
    """A model folder; null: the policy's start (with LoRA: the policy with its adapters off)."""
    precompute_reference: bool = False
    """Compute the reference log-probs once, before training (cached), instead of holding the
    reference model."""
    after_eos: str = "drop"
    """drop | keep: a chat template's text after a response's EOS token (ChatML's newline
    after "<|im_end|>", Llama 2's "</s>" then a newline), for DPO, KTO and reward models. drop
    (the default): a response is scored through its EOS, where generation stops, so the policy
    is not scored on tokens it never generates (supervised fine-tuning does not count them
    either). keep: scored as part of the response, as TRL's DPOTrainer and KTOTrainer tokenize
    it: their token ids, end to end."""


@dataclass
class KTOConfig:
    """Kahneman-Tversky optimization (trainer.objective=kto); see tasks/preference/kto.py. The reference
    is chosen as DPO's: a frozen copy, LoRA's adapters off, or dpo.reference."""
    beta: float = 0.1
    """How far the policy may move from the reference."""
    desirable_weight: float = 1.0
    """The weight of a desirable example's loss."""
    undesirable_weight: float = 1.0
    """The weight of an undesirable example's loss."""


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
