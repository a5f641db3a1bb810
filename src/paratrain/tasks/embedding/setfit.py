"""SetFit classifiers (`data.format=classify`, `trainer.objective=setfit`; Tunstall et al., 2022):
few labelled texts train a sentence-embedding model and a logistic-regression head on it.

1. Contrastive phase: the embedding task (embedding.py) on scored pairs drawn from the labels,
   SetFit's classic pair generation: for each of `embedding.pair_iterations` rounds, each
   training text is paired with a random text of the same label (score 1) and one of another
   label (score 0), drawn with trainer.seed; the loss is CosineSimilarityLoss, so 1 and N workers
   run the same steps as every paratrain task does. Validation texts give pairs the same way.
2. Head: when the model is saved, the training texts are embedded with the trained weights and
   scikit-learn's LogisticRegression (SetFit's default head) is fitted on them.

model/ is the embedding model's sentence-transformers folder plus the head twice: `head.json`
(classes, coefficients, intercepts: what `paratrain generate` reads, nothing unpickled) and
`model_head.pkl` with `config_setfit.json`, the files `setfit.SetFitModel.from_pretrained(path)`
reads (joblib's pickle: setfit's format, written here, never loaded by paratrain).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ...errors import ConfigError
from ..classify import EncodeLabelled
from .embedder import EmbeddingTask, embed_folder, load_embedder
from ..finetuning import Encoder


def draw_pairs(examples: Sequence[dict], rounds: int, seed: int) -> list[dict]:
    """Scored pairs {"text1", "text2", "score"} from {"input_ids", "label"} examples: per round,
    each text with a random same-label text (1.0) and a random other-label text (0.0)."""
    rng = random.Random(seed)
    by_label: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        by_label.setdefault(ex["label"], []).append(i)
    pairs = []
    for _ in range(rounds):
        for i, ex in enumerate(examples):
            same = by_label[ex["label"]]
            other = [j for j in range(len(examples)) if examples[j]["label"] != ex["label"]]
            for j, score in ((rng.choice(same), 1.0), (rng.choice(other), 0.0)):
                pairs.append({"text1": ex["input_ids"], "text2": examples[j]["input_ids"],
                              "score": score})
    return pairs


class _EncodePairs(EncodeLabelled):
    """Labelled texts (classify's encoder) -> scored pairs; keeps the training texts for the
    head."""

    def __init__(self, cfg: Any, tokenizer: Any, notes: list):
        super().__init__(cfg, tokenizer, notes)
        self.rounds, self.seed = cfg.embedding.pair_iterations, cfg.trainer.seed
        self.labelled: list = []

    def __call__(self, rows: list, source_name: str) -> list:
        examples = super().__call__(rows, source_name)
        if not self.labelled:  # the training rows come first
            self.labelled = [{"input_ids": ex["input_ids"], "label": ex["label"]}
                             for ex in examples]
        pairs = draw_pairs(examples, self.rounds, self.seed)
        self.notes.append(f"{source_name}: {len(pairs)} pairs drawn from {len(examples)} "
                          f"labelled texts (embedding.pair_iterations={self.rounds})")
        return pairs

    def task_fields(self) -> dict:
        return {"label_names": list(self.names or ()), "labelled": self.labelled}


@dataclass
class SetFitTask(EmbeddingTask):
    """The contrastive phase of SetFit on an embedding model, and its head (module docstring)."""
    label_names: Sequence[str] = ()
    labelled: list = field(default_factory=list)  # the training texts' {"input_ids", "label"}

    @classmethod
    def encoder(cls, cfg: Any, tokenizer: Any, notes: list) -> Encoder:
        return _EncodePairs(cfg, tokenizer, notes)

    @classmethod
    def recorded_fields(cls, model_info: dict) -> dict:
        return {"label_names": list(model_info.get("labels") or ())}

    def add_files(self, folder: Path) -> None:
        """The embedding model's files, then the head fitted on its training-text embeddings."""
        super().add_files(folder)
        if (folder / "config.json").is_file() and self.labelled:
            write_head(folder, self.labelled, self.label_names, self.tokenizer.pad_token_id)

    def describe(self, n_params: int) -> str:
        return (f"SetFit on {len(self.label_names)} labels, contrastive phase: "
                + super().describe(n_params))

    @property
    def model_info(self) -> dict:
        return {**super().model_info, "labels": list(self.label_names)}


def write_head(folder: Path, labelled: list, names: Sequence[str], pad_id: int) -> None:
    """LogisticRegression on the embeddings of `labelled`, saved as head.json and as setfit's
    model_head.pkl + config_setfit.json."""
    try:
        import joblib
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        raise ConfigError("trainer.objective=setfit fits its head with scikit-learn: "
                          "pip install 'paratrain[setfit]'") from None
    model, pooling = load_embedder(folder)
    x = embed_folder(model, pooling, [ex["input_ids"] for ex in labelled], pad_id).numpy()
    y = [names[ex["label"]] for ex in labelled]
    head = LogisticRegression().fit(x, y)
    (folder / "head.json").write_text(json.dumps({
        "classes": [str(c) for c in head.classes_], "coef": head.coef_.tolist(),
        "intercept": head.intercept_.tolist()}))
    joblib.dump(head, folder / "model_head.pkl")
    (folder / "config_setfit.json").write_text(json.dumps(
        {"labels": list(map(str, head.classes_)), "normalize_embeddings": False}))


def predict(folder: Path, texts: list[str]) -> list[str]:
    """The labels head.json gives the texts' embeddings (sklearn's LogisticRegression.predict:
    the largest decision value; one column for two classes)."""
    import transformers
    head = json.loads((folder / "head.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model, pooling = load_embedder(folder)
    x = embed_folder(model, pooling, tokenizer(texts)["input_ids"], tokenizer.pad_token_id)
    coef = torch.tensor(head["coef"], dtype=torch.float64)  # (C', H)
    scores = x.double() @ coef.T + torch.tensor(head["intercept"], dtype=torch.float64)
    if scores.shape[1] == 1:  # binary: one decision value, > 0 is the second class
        picks = (scores[:, 0] > 0).long()
    else:
        picks = scores.argmax(-1)
    return [head["classes"][int(k)] for k in picks]


def generate_setfit_label(model_dir: Path, prompt: str, opts: Any) -> str:
    """`paratrain generate` on a SetFit run: the prompt's label."""
    print(f"paratrain: {opts.run_dir} is a SetFit classifier: it labels --prompt instead of "
          "continuing it", file=sys.stderr)
    return predict(Path(model_dir), [prompt])[0]
