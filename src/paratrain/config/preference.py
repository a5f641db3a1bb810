"""Preference objectives (data.format=preference: tasks/preference/): the `dpo` and `kto`
sections, their keys (one docstring each, as in sections.py), the value names they accept and
their checks, run when a config is built, torch-free: one line naming the key and a value that
works. tree.py joins the sections into `TrainConfig`; config/registry.py names the checks in the
preference tasks' specs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError
from .model_folder import model_config

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")  # a preference record's fields


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
class ORPOConfig:
    """Odds-ratio preference optimization (trainer.objective=orpo): no reference model; see
    tasks/preference/orpo.py (TRL's ORPOTrainer)."""
    beta: float = 0.1
    """The weight of the odds-ratio term beside the chosen response's NLL (TRL's beta, the
    paper's lambda)."""


@dataclass
class SimPOConfig:
    """SimPO (trainer.objective=simpo): no reference model; see tasks/preference/orpo.py (TRL's
    CPOTrainer with loss_type=simpo; TRL's defaults)."""
    beta: float = 0.1
    """The scale of the margin between the mean log-probs (the SimPO paper uses 2 to 2.5)."""
    gamma: float = 0.5
    """The target reward margin (TRL's simpo_gamma)."""
    cpo_alpha: float = 1.0
    """The weight of the chosen responses' NLL (TRL's cpo_alpha; 0: the SimPO paper's loss
    alone)."""


# dpo.loss: tasks/preference/dpo.py's DPO_LOSSES computes each one
DPO_LOSSES = ("sigmoid", "ipo", "ipo_sum", "hinge")


# dpo.after_eos: tasks/preference/pairs.py cuts a response at its EOS (drop) or not (keep)
AFTER_EOS = ("drop", "keep")


def check_preference_fields(cfg: Any) -> None:
    """Every preference task: three different record fields, a known dpo.after_eos."""
    if cfg.dpo.after_eos not in AFTER_EOS:
        raise ConfigError(f"dpo.after_eos={cfg.dpo.after_eos!r} is not one of: "
                          f"{', '.join(AFTER_EOS)} (keep: TRL's token ids)")
    d = cfg.data
    fields = {"data.prompt_field": d.prompt_field, "data.chosen_field": d.chosen_field,
              "data.rejected_field": d.rejected_field}
    if not all(fields.values()) or len(set(fields.values())) < 3:
        raise ConfigError("data.format=preference needs three different record fields: "
                          + ", ".join(f"{k}={v!r}" for k, v in fields.items()))


def check_dpo(cfg: Any) -> None:
    """dpo.*: a positive beta, a known loss, label smoothing for the sigmoid loss only, and a
    reference model (when given) that reads the same token ids as the policy."""
    p = cfg.dpo
    if not p.beta > 0:
        raise ConfigError(f"dpo.beta={p.beta} must be positive (the DPO paper uses 0.1 to 0.5)")
    if p.loss not in DPO_LOSSES:
        raise ConfigError(f"dpo.loss={p.loss!r} is not one of: {', '.join(DPO_LOSSES)}")
    if not 0.0 <= p.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={p.label_smoothing} must be in [0, 0.5) (the "
                          "assumed share of flipped preference labels)")
    if p.label_smoothing and p.loss != "sigmoid":
        raise ConfigError(f"dpo.label_smoothing applies to dpo.loss=sigmoid, not {p.loss}; "
                          "set it to 0")
    if p.reference is not None:
        _check_reference(p.reference, cfg.model.path,
                         cfg.data.tokenizer if cfg.data.tokenizer != "auto" else cfg.model.path)


def _check_reference(reference: str, policy: str, tokenizer: str) -> None:
    folder = Path(reference).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"dpo.reference={reference!r} is not a model folder with a "
                          "config.json; give a local from_pretrained folder (nothing is "
                          "downloaded) or leave dpo.reference unset (the policy's start)")
    vocab = (model_config(folder).get("vocab_size"), model_config(policy).get("vocab_size"))
    if vocab[0] != vocab[1]:
        raise ConfigError(f"dpo.reference={reference!r} has vocab_size={vocab[0]}, model.path "
                          f"{vocab[1]}: a reference must score the policy's token ids; use a "
                          "model with the same tokenizer")
    mine, theirs = _vocabulary(Path(tokenizer).expanduser()), _vocabulary(folder)
    if mine is not None and theirs is not None and mine != theirs:
        differ = len(set(mine.items()) ^ set(theirs.items()))
        raise ConfigError(f"dpo.reference={reference!r} has another tokenizer than the policy's "
                          f"({differ} token ids differ): a reference must score the same token "
                          "ids; use a model trained with the same tokenizer")


def _vocabulary(folder: Path) -> Optional[dict]:
    """token -> id of a folder's tokenizer.json (special tokens included); None without one."""
    try:
        tok = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = dict(tok.get("model", {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    return vocab


def check_kto(cfg: Any) -> None:
    """kto.*: a positive beta and positive weights; the reference as DPO's, not precomputed."""
    p = cfg.kto
    if not p.beta > 0:
        raise ConfigError(f"kto.beta={p.beta} must be positive (TRL's default: 0.1)")
    for key in ("desirable_weight", "undesirable_weight"):
        if not getattr(p, key) > 0:
            raise ConfigError(f"kto.{key}={getattr(p, key)} must be positive (1.0: TRL's "
                              "default; raise the weight of the rarer kind of example)")
    if cfg.dpo.precompute_reference:
        raise ConfigError("dpo.precompute_reference applies to trainer.objective=dpo; KTO "
                          "scores each batch's mismatched sequences with the reference: set it "
                          "to false")
    if cfg.dpo.reference is not None:
        _check_reference(cfg.dpo.reference, cfg.model.path,
                         cfg.data.tokenizer if cfg.data.tokenizer != "auto" else cfg.model.path)


def check_orpo(cfg: Any) -> None:
    """orpo.*: a positive beta; no reference keys (ORPO has none)."""
    _no_reference(cfg, "orpo")
    if not cfg.orpo.beta > 0:
        raise ConfigError(f"orpo.beta={cfg.orpo.beta} must be positive (TRL's default: 0.1)")


def check_simpo(cfg: Any) -> None:
    """simpo.*: a positive beta, an NLL weight of 0 or more; no reference keys."""
    _no_reference(cfg, "simpo")
    p = cfg.simpo
    if not p.beta > 0:
        raise ConfigError(f"simpo.beta={p.beta} must be positive (TRL's default: 0.1; the "
                          "SimPO paper: 2 to 2.5)")
    if not p.cpo_alpha >= 0:
        raise ConfigError(f"simpo.cpo_alpha={p.cpo_alpha} must be 0 or more (1.0: TRL's "
                          "default; 0: SimPO's loss alone)")


def _no_reference(cfg: Any, objective: str) -> None:
    if cfg.dpo.reference is not None or cfg.dpo.precompute_reference:
        raise ConfigError(f"dpo.reference and dpo.precompute_reference apply to "
                          f"trainer.objective=dpo or kto; {objective} uses no reference model: "
                          "leave them unset")
