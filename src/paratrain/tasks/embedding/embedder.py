"""Sentence-embedding models (`data.format=embedding`): an encoder or a decoder from model.path
(transformers' AutoModel, no head) whose hidden states are pooled into one vector per text
(`embedding.pooling`: mean over the real tokens, the first (CLS) token, or the last real token),
trained as sentence-transformers trains them:

- anchor / positive [/ negative] records: MultipleNegativesRankingLoss. Each anchor's logits are
  scale x the cosine similarities to every positive and every hard negative of the *global*
  batch; the loss is the cross-entropy of its own positive. `embedding.symmetric`: also each
  positive against every anchor, the two averaged (sentence-transformers' directions
  query_to_doc + doc_to_query, per_direction).
- text1 / text2 / score records: CosineSimilarityLoss, (cos(u, v) - score)^2, or with
  `embedding.pair_loss=cosent` CoSENT over the global batch (pair_losses.py).

On N workers each rank embeds its share and the candidates (and, for the symmetric loss, the
anchors) are gathered from every rank *with their gradients* (`gather`: the backward pass sums
each rank's gradient into the rank that computed the embedding), so a global batch of B pairs
sees B - 1 in-batch negatives (plus the hard negatives) whatever the world size, and 1 and N
workers run the same steps. With gradient accumulation the candidates are those of every
micro-batch of the step on every rank (GradCache, grad_cache.py: the step is embedded first
without gradients, then trained on one micro-batch at a time), so 1 worker with accumulation k
runs the steps of k workers, with the activation memory of one micro-batch: the way to thousands
of in-batch negatives on one device. The loss unit is an anchor (a pair).

Validation is exact whatever the world size: its batches are blocks of EVAL_BLOCK consecutive
held-out pairs (by global index, dealt to the workers in turn: runtime/validation.py), each pair
once, and each anchor is scored against its block's positives and negatives. It reports the
loss and, for anchor / positive records, `val_accuracy` (the anchor's positive ranked first) and
`val_mrr@10`, counts summed over the workers. The saved model/ folder is a sentence-transformers
folder (the transformers model, modules.json, 1_Pooling/, 2_Normalize/ with
`embedding.normalize`), which `SentenceTransformer(path)` loads and which embeds a text as
training did.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...config.embedding import POOLINGS
from ...config.model_folder import refuse_encoder_decoder
from ...errors import ConfigError
from ..base import NO_FROZEN, Frozen, to_device
from ..finetuning import Encoder, PretrainedTask
from .gather import gather

EVAL_BLOCK = 16  # held-out pairs ranked against each other: the same on any number of workers


def _mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (N, T, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def _cls(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hidden[:, 0]


def _last(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    last = mask.sum(-1) - 1  # (N,) the last real token
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


# each of config/embedding.POOLINGS (what embedding.pooling accepts), computed
POOL: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mean": _mean, "cls": _cls, "last": _last}


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """(N, T, H) hidden states, (N, T) attention mask (right-padded) -> (N, H) embeddings."""
    return POOL[pooling](hidden, mask)


def ranking_losses(anchors: torch.Tensor, docs: list[torch.Tensor], scale: float,
                   symmetric: bool) -> torch.Tensor:
    """(B,) MultipleNegativesRankingLoss of this rank's anchors (B, H) against `docs` (the
    positives (B, H), then any hard negatives (B, H)) gathered from every rank."""
    all_docs, offset = zip(*(gather(d) for d in docs))  # each (W B, H)
    B = anchors.shape[0]
    own = torch.arange(offset[0], offset[0] + B, device=anchors.device)  # (B,)
    logits = scale * _cos(anchors, torch.cat(all_docs))  # (B, k W B)
    losses = F.cross_entropy(logits, own, reduction="none")  # (B,)
    if symmetric:  # each positive against every anchor
        all_anchors, _ = gather(anchors)  # (W B, H)
        back = scale * _cos(docs[0], all_anchors)  # (B, W B)
        losses = (losses + F.cross_entropy(back, own, reduction="none")) / 2
    return losses


def positive_ranks(anchors: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """(B,) the rank (1: first) of each anchor's own positive among `docs` ((k B, H): the B
    positives, then any hard negatives) by cosine similarity; ties rank the positive first."""
    scores = _cos(anchors, docs)  # (B, k B)
    own = scores.diagonal().unsqueeze(1)  # (B, 1) each anchor's positive
    return (scores > own).sum(1) + 1


def retrieval_counts(ranks: torch.Tensor) -> dict:
    """Counts summed over the workers: top1 (positive first), rr10 (reciprocal rank within 10)."""
    return {"top1": (ranks == 1).sum().double(),
            "rr10": torch.where(ranks <= 10, 1.0 / ranks, 0.0).sum().double(),
            "samples": float(ranks.shape[0])}


def cosine_loss(texts: tuple[torch.Tensor, ...], score: torch.Tensor
                ) -> tuple[torch.Tensor, int, dict]:
    """CosineSimilarityLoss summed over scored pairs: (cos(u, v) - score)^2, u, v (B, H)."""
    cos = F.cosine_similarity(texts[0], texts[1], dim=-1)  # (B,)
    return ((cos - score.float()) ** 2).sum(), cos.shape[0], {}


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N, H), (M, H) -> (N, M) cosine similarities."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


@dataclass
class EmbeddingTask(PretrainedTask):
    """A pretrained model pooled into text embeddings (module docstring)."""
    sample_name: ClassVar[str] = "pairs"
    unit_name: ClassVar[str] = "pairs"
    eval_block: ClassVar[int] = EVAL_BLOCK  # validation batches: blocks of consecutive pairs
    perplexity: ClassVar[bool] = False
    units_per_sample: ClassVar[Optional[int]] = 1  # an anchor (or a scored pair)
    lora_task_type: ClassVar[str] = "FEATURE_EXTRACTION"
    auto_class: ClassVar[str] = "AutoModel"

    @classmethod
    def check_model(cls, cfg: Any) -> None:
        refuse_encoder_decoder(cfg.model.path, "data.format=embedding trains an encoder "
                                               "(BERT-like) or a decoder-only model")
        kind = decoder_only(cfg.model.path)
        if cfg.embedding.pooling == "cls" and kind:
            raise ConfigError(
                f"embedding.pooling=cls on model.path={cfg.model.path!r}, a decoder-only model "
                f"({kind}): its first token attends to nothing after it, so every text that "
                "starts alike (its BOS) embeds the same; use embedding.pooling=last or mean")

    @classmethod
    def encoder(cls, cfg: Any, tokenizer: Any, notes: list) -> Encoder:
        return _Encode(tokenizer, cfg.max_length, notes, cfg.embedding.pair_loss == "cosine")

    @classmethod
    def dataset(cls, examples: list) -> Any:
        from .records import embedding_dataset
        return embedding_dataset(examples)

    @property
    def collate(self) -> Callable[[list], Any]:
        from .records import EmbeddingCollate
        return EmbeddingCollate(self.tokenizer.pad_token_id)

    def load_pretrained(self) -> nn.Module:
        from ...models.hf import HFArgs, build_hf
        return without_pooler(build_hf(HFArgs.of(self.cfg.model, len(self.tokenizer),
                                                 auto_class=self.auto_class)))

    def count_units(self, batch: dict) -> int:
        return int(batch["input_ids"].shape[0]) // batch["columns"]

    def embed(self, model: nn.Module, batch: dict, amp: ContextManager
              ) -> tuple[torch.Tensor, ...]:
        """The batch's texts as k float32 embeddings (B, H): anchors, positives, negatives."""
        with amp:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return pool(out.last_hidden_state.float(), batch["attention_mask"],
                    self.cfg.embedding.pooling).chunk(batch["columns"])

    def rollout(self, model: nn.Module, micro: list, step: int, env: Any, amp: ContextManager,
                frozen: Frozen = NO_FROZEN) -> tuple[list, dict]:
        """Under gradient accumulation, the ranking loss of the whole step first (GradCache,
        grad_cache.py): each micro-batch leaves with the gradient of its embeddings. Scored
        pairs (each pair its own loss) and single micro-batches go through unchanged."""
        e = self.cfg.embedding
        cosine = e.pair_loss == "cosine"
        if len(micro) == 1 or any(mb is None or ("score" in mb and cosine) for mb in micro):
            return micro, {}
        from .grad_cache import cache_step
        batches = [to_device(mb, env.device) for mb in micro]
        if "score" in batches[0]:  # CoSENT: every pair of the step against every other
            from .pair_losses import cosent_losses
            scores = torch.cat([b["score"] for b in batches])  # (m B,)
            losses = lambda cols: cosent_losses(cols[0], cols[1], scores, e.scale)  # noqa: E731
        else:
            losses = lambda cols: ranking_losses(cols[0], cols[1:], e.scale,  # noqa: E731
                                                 e.symmetric)
        return cache_step(batches, lambda b: self.embed(model, b, amp), losses, env.device), {}

    def train_counts(self, model: nn.Module, batch: dict, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        """(sum of the anchors' losses, anchors, {}): candidates from every rank (and, when
        `rollout` cached the step, from its every micro-batch)."""
        batch = to_device(batch, device)
        cached = batch.get("cached")
        if cached is not None:
            from .grad_cache import surrogate
            with cached.state.replayed():  # dropout: the masks of the cached pass
                texts = self.embed(model, batch, amp)
            return surrogate(texts, cached), texts[0].shape[0], {}
        texts = self.embed(model, batch, amp)
        if "score" in batch:
            return self.pair_loss(texts, batch["score"], across_ranks=True)
        e = self.cfg.embedding
        losses = ranking_losses(texts[0], list(texts[1:]), e.scale, e.symmetric)
        return losses.sum(), losses.shape[0], {}

    def pair_loss(self, texts: tuple, score: torch.Tensor, across_ranks: bool
                  ) -> tuple[torch.Tensor, int, dict]:
        """Scored pairs' loss: embedding.pair_loss (CoSENT over every rank's pairs while
        training, over the block at validation)."""
        if self.cfg.embedding.pair_loss == "cosine":
            return cosine_loss(texts, score)
        from .pair_losses import cosent_losses
        losses = cosent_losses(texts[0], texts[1], score, self.cfg.embedding.scale, across_ranks)
        return losses.sum(), losses.shape[0], {}

    def eval_counts(self, model: nn.Module, batch: dict, device: torch.device,
                    amp: ContextManager, frozen: Frozen = NO_FROZEN
                    ) -> tuple[torch.Tensor, int, dict]:
        """The loss of a block of held-out pairs (each anchor against the block's candidates),
        and how its anchors rank their positives."""
        batch = to_device(batch, device)
        texts = self.embed(model, batch, amp)
        if "score" in batch:
            return self.pair_loss(texts, batch["score"], across_ranks=False)
        docs = torch.cat(texts[1:])  # (k B, H)
        B = texts[0].shape[0]
        own = torch.arange(B, device=docs.device)  # (B,)
        loss = F.cross_entropy(self.cfg.embedding.scale * _cos(texts[0], docs), own,
                               reduction="sum")
        return loss, B, retrieval_counts(positive_ranks(texts[0], docs))

    def eval_metrics(self, counts: dict) -> dict:
        n = counts.get("samples", 0.0)
        if not n:
            return {}
        return {"val_accuracy": counts["top1"] / n, "val_mrr@10": counts["rr10"] / n,
                "val_samples": int(n)}

    def add_files(self, folder: Path) -> None:
        """The tokenizer (with the pad token it trained with: sentence-transformers pads) and,
        beside a model's weights (not an adapter's), sentence-transformers' files."""
        from ...models.hf import make_portable
        self.tokenizer.save_pretrained(folder)
        make_portable(folder)
        if (folder / "config.json").is_file():
            write_sentence_transformers_files(folder, self.cfg, _hidden_size(folder))

    def describe(self, n_params: int) -> str:
        e = self.cfg.embedding
        return (f"embedding model ({e.pooling} pooling, scale {e.scale}"
                f"{', symmetric' if e.symmetric else ''}): " + super().describe(n_params))


def decoder_only(path: Optional[str]) -> Optional[str]:
    """model.path's model type when transformers knows it as a causal LM and not as a masked
    LM (Llama, GPT-2: causal attention; BERT and RoBERTa are both, bidirectional), else None."""
    from ...config.model_folder import model_config
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    kind = model_config(path).get("model_type")
    causal = kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return kind if causal and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES else None


def without_pooler(model: nn.Module) -> nn.Module:
    """The model without the pooler of BERT-like encoders (a dense layer over the first token,
    trained for next-sentence prediction), which no pooling here reads (`cls` pools the first
    token's hidden state, as sentence-transformers does). Left in, its parameters get no
    gradient, and DDP, which expects a gradient for every trained parameter, stops at step 2.
    Only classes built to run without one (their `add_pooling_layer`) lose it; the saved folder
    then has no pooler weights (transformers initializes one if a loader asks for it)."""
    import inspect
    if isinstance(getattr(model, "pooler", None), nn.Module) and \
            "add_pooling_layer" in inspect.signature(type(model).__init__).parameters:
        model.pooler = None
    return model


def _hidden_size(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    return int(config.get("hidden_size") or config.get("d_model") or config["n_embd"])


def write_sentence_transformers_files(folder: Path, cfg: Any, hidden: int) -> None:
    """modules.json (Transformer, Pooling[, Normalize]), 1_Pooling/config.json,
    sentence_bert_config.json: what `SentenceTransformer(folder)` reads."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if cfg.embedding.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, "include_prompt": True,
               **{key: mode == cfg.embedding.pooling for mode, key in POOLINGS.items()}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": cfg.max_length, "do_lower_case": False}, indent=2))


class _Encode(Encoder):
    def __init__(self, tokenizer: Any, max_length: int, notes: list, bounded: bool):
        self.tokenizer, self.max_length, self.notes = tokenizer, max_length, notes
        self.bounded = bounded  # scores in [-1, 1]: the cosine loss fits them

    def __call__(self, rows: list, source_name: str) -> list:
        from .records import encode_embedding
        examples, note = encode_embedding(rows, self.tokenizer, max_length=self.max_length,
                                          source_name=source_name, bounded=self.bounded)
        self.notes.append(note)
        return examples


def load_embedder(folder: Path) -> tuple[nn.Module, str]:
    """(the transformers model of a saved embedding folder, in eval mode on the CPU, its pooling
    from 1_Pooling/config.json)."""
    import transformers
    model = transformers.AutoModel.from_pretrained(folder, local_files_only=True,
                                                   use_safetensors=True).eval()
    config = json.loads((Path(folder) / "1_Pooling" / "config.json").read_text())
    return model, next(m for m, key in POOLINGS.items() if config.get(key))


@torch.no_grad()
def embed_folder(model: nn.Module, pooling: str, texts: list, pad_id: int,
                 batch: int = 32) -> torch.Tensor:
    """(N, H) float32 embeddings of token-id lists, `batch` at a time, right-padded."""
    from ...data.ragged import pad_rows
    out = []
    for start in range(0, len(texts), batch):
        ids, mask = pad_rows([torch.as_tensor(t) for t in texts[start:start + batch]], pad_id)
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        out.append(pool(hidden, mask, pooling))
    return torch.cat(out)


def generate_embedding(model_dir: Path, prompt: str, opts: Any) -> str:
    """`paratrain generate` on an embedding model's run: the prompt's embedding (JSON), as
    sentence-transformers computes it from the saved folder (pooling and normalization)."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model, pooling = load_embedder(Path(model_dir))
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ConfigError("--prompt encodes to no tokens; give some text")
    vector = embed_folder(model, pooling, [ids], tokenizer.pad_token_id)[0]
    if (Path(model_dir) / "2_Normalize").is_dir():
        vector = F.normalize(vector, dim=-1)
    print(f"paratrain: {opts.run_dir} is an embedding model: it prints the embedding of "
          f"--prompt ({vector.numel()} numbers) instead of continuing it", file=sys.stderr)
    return json.dumps([round(float(v), 6) for v in vector])
