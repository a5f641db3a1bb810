"""The task registry: what each `data.format` trains, in one table.

Every question that depends on the format is answered here, once: which Task class prepares it
(imported only when a run needs it, so config checks and `--help` stay free of torch), whether
it fine-tunes a pretrained Hugging Face model, the record fields the Python API recognises, the
config checks of its own, and what `paratrain generate` does with a finished run. Nothing else
compares `data.format` to a string.

One format may serve several tasks: preference records train a DPO policy or a reward model
(`trainer.objective`), and input->output pairs train a causal LM or an encoder-decoder model
(what model.path is). `for_config` picks the one task of a config, once, for `TrainConfig.task_spec`
(which carries the decision from then on); `get` is a format's first (default) task; `recorded`
the task a run's config.yaml recorded.

Adding a task is one module (its Task class) plus one `register(TaskSpec(...))` line below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import ConfigError
from .embedding import check_embedding
from .model_folder import model_config
from .preference import (
    PREFERENCE_FIELDS,
    check_dpo,
    check_kto,
    check_orpo,
    check_preference_fields,
    check_simpo,
)
from .rl import check_grpo, check_ppo, check_rloo


@dataclass(frozen=True)
class TaskSpec:
    """One registered task. `task` and `generate` are "module:attribute" paths, imported on use."""
    name: str  # the data.format value
    task: str  # the Task class: a classmethod `prepare(cfg, env, records, say)` builds it
    summary: str  # one line for listings and errors
    pretrained: bool = False  # fine-tunes model.path (model.arch=hf) with its own tokenizer
    packed: bool = False  # a corpus cut into full windows (no pads): every token counts
    pipelined: bool = False  # its built-in llama / gpt can be cut into pipeline stages
    record_fields: tuple[str, ...] = ()  # fields of its records (the Python API's lists)
    checks: tuple[Callable[[Any], None], ...] = field(default=())  # on a TrainConfig
    generate: str = "paratrain.models.generate:generate_from_run"  # (model_dir, prompt, opts)
    objective: str = "lm"  # its trainer.objective value; a format's first task is auto's
    # the models it trains: True encoder-decoder (T5, BART), False decoder-only, None either (its
    # own check_model refuses what it cannot train)
    encoder_decoder: Optional[bool] = False
    packs: bool = False  # data.pack=true: several examples per row, kept apart (data/packing.py)
    no_pack: str = "it reads one output per row (a class or an embedding)"  # and why not

    def load(self) -> Any:
        """The Task class."""
        return _resolve(self.task)

    def generator(self) -> Callable[..., str]:
        """What `paratrain generate` calls: (model_dir, prompt, GenerateOptions) -> text."""
        return _resolve(self.generate)


_TASKS: dict[str, TaskSpec] = {}  # data.format -> its first (default) task
_OTHERS: list[TaskSpec] = []  # the further tasks of a format, in registration order


def register(spec: TaskSpec) -> TaskSpec:
    first = _TASKS.get(spec.name)
    if first is None:
        _TASKS[spec.name] = spec
    elif spec.objective in [s.objective for s in _of(spec.name)]:
        raise ValueError(f"a task named {spec.name!r} is registered already")
    else:
        _OTHERS.append(spec)
    return spec


def _of(name: str) -> list[TaskSpec]:
    return [_TASKS[name]] + [s for s in _OTHERS if s.name == name]


def select(name: str, objective: str = "auto", model: Optional[dict] = None,
           where: str = "model.path") -> TaskSpec:
    """The task of data.format `name` for `trainer.objective` and the model (`model`: its
    config.json; `where` names it). auto: the format's task made for this kind of model
    (encoder-decoder or decoder-only), else its first. One ConfigError line when none fits."""
    specs = _of(get(name).name)
    encdec = bool((model or {}).get("is_encoder_decoder"))
    if objective == "auto":
        specs = [s for s in specs if s.encoder_decoder is encdec][:1] or specs[:1]
    else:
        specs = [s for s in specs if s.objective == objective]
        if not specs:
            raise ConfigError(f"trainer.objective={objective!r} does not apply to data.format="
                              f"{name}; it trains: {', '.join(s.objective for s in _of(name))} "
                              f"(auto: {_of(name)[0].objective})")
    fits = [s for s in specs if s.encoder_decoder in (None, encdec)]
    if fits:
        return fits[0]
    kind = (model or {}).get("model_type", "?")
    if encdec:
        others = sorted({s.name for s in _TASKS.values() if s.encoder_decoder} |
                        {s.name for s in _OTHERS if s.encoder_decoder})
        raise ConfigError(f"{where} is an encoder-decoder model ({kind}); data.format={name} "
                          f"with trainer.objective={objective} trains decoder-only models"
                          + (f"; an encoder-decoder model trains on data.format="
                             f"{' or '.join(others)}" if others else ""))
    raise ConfigError(f"trainer.objective={objective} trains an encoder-decoder model (T5, "
                      f"BART); {where} is a decoder-only model ({kind}): use "
                      "trainer.objective=auto")


def for_config(cfg: Any) -> TaskSpec:
    """The one task a TrainConfig trains (see `select`)."""
    m = cfg.model
    model = model_config(m.path) if m.arch == "hf" else {}
    return select(cfg.data.format, cfg.trainer.objective, model, where=f"model.path={m.path!r}")



def specs() -> tuple[TaskSpec, ...]:
    """Every registered task, format by format (a format's default first)."""
    return tuple(s for name in _TASKS for s in _of(name))


def names(pretrained: Optional[bool] = None) -> tuple[str, ...]:
    """Registered names in registration order (only those that do / do not fine-tune)."""
    return tuple(n for n, s in _TASKS.items() if pretrained is None or s.pretrained == pretrained)


def get(name: str, key: str = "data.format") -> TaskSpec:
    """The spec of `name`, or one ConfigError line listing what is registered."""
    spec = _TASKS.get(name)
    if spec is None:
        raise ConfigError(f"{key}={name!r} is not one of: {', '.join(_TASKS)}")
    return spec


def recorded(name: str, objective: str, key: str = "data.format") -> TaskSpec:
    """The task a run recorded in its config.yaml (data.format and trainer.objective, as the
    run decided them): looked up, not decided again; `auto` (a run that recorded no decision)
    is the format's first task."""
    if objective == "auto":
        return get(name, key)
    for spec in _of(get(name, key).name):
        if spec.objective == objective:
            return spec
    raise ConfigError(f"{key}={name} trains no trainer.objective={objective!r}; it trains: "
                      f"{', '.join(s.objective for s in _of(name))}")


DEFAULT_RECORDS = "pairs"  # what the Python API's records are when nothing else matches


def recognize(record: dict) -> TaskSpec:
    """The fine-tuning task whose fields a record carries (Trainer(model=DIR, train_data=[...])),
    in registration order; pairs when no other matches (its encoder names what is missing)."""
    for spec in _TASKS.values():
        if spec.pretrained and spec.name != DEFAULT_RECORDS and spec.record_fields and \
                set(spec.record_fields) <= set(record):
            return spec
    return _TASKS[DEFAULT_RECORDS]


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _check_classify(cfg: Any) -> None:
    d = cfg.data
    if not (d.text_field and d.label_field):
        raise ConfigError("data.format=classify needs data.text_field and data.label_field, the "
                          "names of the text and label fields of the records")


register(TaskSpec(
    "packed", "paratrain.tasks.pretraining:LMTask", packed=True, pipelined=True,
    summary="a language model on a corpus cut into full windows of data.seq_length tokens"))
register(TaskSpec(
    "padded", "paratrain.tasks.pretraining:LMTask",
    summary="a language model on a corpus, one document per padded row"))
register(TaskSpec(
    "pairs", "paratrain.tasks.sft:PairsTask", pretrained=True, objective="sft",
    record_fields=("input", "output"), generate="paratrain.models.hf:generate_hf_reply",
    packs=True, summary="a pretrained causal LM on input->output pairs, the loss on the outputs"))
register(TaskSpec(
    "chat", "paratrain.tasks.sft:ChatTask", pretrained=True, objective="sft",
    record_fields=("messages",), generate="paratrain.models.hf:generate_hf_chat",
    packs=True, summary="a pretrained causal LM on conversations, the loss on the assistant turns"))
register(TaskSpec(
    "classify", "paratrain.tasks.classify:ClassifyTask", pretrained=True, objective="classify",
    record_fields=("text", "label"), checks=(_check_classify,), encoder_decoder=None,
    generate="paratrain.tasks.classify:generate_label",
    summary="a pretrained model with a sequence-classification head on labelled texts"))
register(TaskSpec(
    "preference", "paratrain.tasks.preference.dpo:DPOTask", pretrained=True, objective="dpo",
    record_fields=PREFERENCE_FIELDS, checks=(check_preference_fields, check_dpo), packs=True,
    generate="paratrain.models.hf:generate_hf_reply",  # prompts rendered as pairs' inputs
    summary="DPO: a pretrained causal LM on prompt/chosen/rejected records, against a frozen "
            "reference"))
register(TaskSpec(
    "preference", "paratrain.tasks.preference.reward:RewardTask", pretrained=True, objective="reward",
    record_fields=PREFERENCE_FIELDS, checks=(check_preference_fields,), encoder_decoder=None,
    generate="paratrain.tasks.preference.reward:generate_score", packs=True,
    summary="a reward model (a one-score head) on preference pairs, Bradley-Terry loss"))
register(TaskSpec(
    "preference", "paratrain.tasks.preference.kto:KTOTask", pretrained=True, objective="kto",
    record_fields=PREFERENCE_FIELDS, checks=(check_kto,), packs=True,
    generate="paratrain.models.hf:generate_hf_reply",
    summary="KTO: a pretrained causal LM on desirable / undesirable completions (preference "
            "pairs, or prompt/completion/label records), against a frozen reference"))
register(TaskSpec(
    "preference", "paratrain.tasks.preference.orpo:ORPOTask", pretrained=True, objective="orpo",
    record_fields=PREFERENCE_FIELDS, checks=(check_preference_fields, check_orpo),
    generate="paratrain.models.hf:generate_hf_reply",
    summary="ORPO: a pretrained causal LM on preference pairs, odds ratio + NLL, no reference"))
register(TaskSpec(
    "preference", "paratrain.tasks.preference.orpo:SimPOTask", pretrained=True,
    objective="simpo", record_fields=PREFERENCE_FIELDS,
    checks=(check_preference_fields, check_simpo), generate="paratrain.models.hf:generate_hf_reply",
    summary="SimPO: a pretrained causal LM on preference pairs, a margin on mean log-probs"))
register(TaskSpec(
    "embedding", "paratrain.tasks.embedding.embedder:EmbeddingTask", pretrained=True,
    objective="embedding", record_fields=("anchor", "positive"), checks=(check_embedding,),
    encoder_decoder=None, generate="paratrain.tasks.embedding.embedder:generate_embedding",
    summary="a sentence-embedding model (an encoder or decoder, pooled) on anchor/positive"
            "[/negative] records (in-batch negatives gathered over every worker) or scored "
            "text1/text2 pairs (cosine similarity)"))
register(TaskSpec(
    "classify", "paratrain.tasks.embedding.setfit:SetFitTask", pretrained=True, objective="setfit",
    record_fields=("text", "label"), checks=(_check_classify, check_embedding),
    encoder_decoder=None, generate="paratrain.tasks.embedding.setfit:generate_setfit_label",
    summary="SetFit: an embedding model trained on pairs drawn from labelled texts, then a "
            "logistic-regression head"))
register(TaskSpec(
    "pairs", "paratrain.tasks.seq2seq:Seq2SeqTask", pretrained=True, objective="seq2seq",
    record_fields=("input", "output"), encoder_decoder=True,
    generate="paratrain.tasks.seq2seq:generate_seq2seq",
    no_pack="an encoder-decoder's encoder rows and decoder targets would each need their own "
            "block mask, which transformers' T5 / BART do not take",
    summary="a pretrained encoder-decoder model (T5, BART) on input->output pairs, the loss on "
            "the outputs"))
register(TaskSpec(
    "prompts", "paratrain.tasks.rl.grpo:GRPOTask", pretrained=True, objective="grpo",
    record_fields=("prompt",), checks=(check_grpo,), packs=True,  # the learning pass
    generate="paratrain.models.hf:generate_hf_reply",  # prompts rendered as in training
    summary="online RL (GRPO): a pretrained causal LM samples completions of prompts and learns "
            "from their rewards (rl.*)"))
register(TaskSpec(
    "prompts", "paratrain.tasks.rl.ppo:PPOTask", pretrained=True, objective="ppo",
    record_fields=("prompt",), checks=(check_ppo,), packs=True,  # the learning pass
    generate="paratrain.models.hf:generate_hf_reply",
    summary="online RL (PPO): a pretrained causal LM with a value head learns from the rewards "
            "of its own completions (rl.*)"))
register(TaskSpec(
    "prompts", "paratrain.tasks.rl.rloo:RLOOTask", pretrained=True, objective="rloo",
    record_fields=("prompt",), checks=(check_rloo,), packs=True,  # the learning pass
    generate="paratrain.models.hf:generate_hf_reply",
    summary="online RL (RLOO): a pretrained causal LM learns from its completions' rewards, "
            "each against the mean of its prompt's other completions (rl.*)"))
