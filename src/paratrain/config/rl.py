"""The `rl` section (online RL: tasks/rl/grpo.py, tasks/rl/ppo.py) and what it may hold, checked when
a config is built, torch-free: one line naming the key and a value that works. Whether each
reward function can be imported is checked by the task before any worker starts (importing may
need torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from ..errors import ConfigError, check_choice


@dataclass
class RLConfig:
    """Online RL (data.format=prompts, trainer.objective=grpo, rloo or ppo): the policy samples
    completions of each prompt, they are scored, and it learns from them; TRL 1.16
    GRPOTrainer's defaults and names (RLOO: TRL's RLOOTrainer; PPO: TRL's PPOTrainer). See
    tasks/rl/grpo.py, tasks/rl/rloo.py, tasks/rl/ppo.py."""
    reward_functions: List[str] = field(default_factory=list)
    """`module:function` names of reward functions `f(prompts, completions, **kwargs) ->
    list[float]`, one score per completion (None: not scored), called as TRL calls them: the
    records' other fields as keyword lists aligned with the completions, `completion_ids`,
    `trainer_state.global_step`; the Python API also takes the functions themselves."""
    reward_models: List[str] = field(default_factory=list)
    """Reward model folders (what trainer.objective=reward writes to model/, or any one-label
    sequence-classification model): each scores prompt + completion, frozen and sharded like
    the policy."""
    reward_weights: Optional[List[float]] = None
    """One weight per reward function, then per reward model; the reward is their weighted
    sum. null: all 1.0."""
    num_generations: int = 8
    """Completions sampled per prompt (grpo: a group, whose mean reward is the baseline; ppo:
    1 is enough)."""
    max_new_tokens: int = 512
    """The longest completion, in tokens (TRL's max_completion_length); sampling stops at EOS."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the log-probabilities are taken at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1.0: off)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: off)."""
    min_p: Optional[float] = None
    """Drop tokens less likely than min_p x the likeliest one (null: off; TRL's min_p)."""
    repetition_penalty: float = 1.0
    """Penalise the tokens a row already holds (prompt and completion so far; > 1 penalises,
    1.0: off), as transformers does; the log-probabilities learnt from are not penalised."""
    beta: float = 0.0
    """KL coefficient to the reference (the policy's start; with LoRA, the policy with its
    adapters off); 0.0: no reference is held (TRL's default; DeepSeek-R1 used 0.001)."""
    epsilon: float = 0.2
    """Clipping of the probability ratio, lower bound 1 - epsilon."""
    epsilon_high: Optional[float] = None
    """Upper clipping bound 1 + epsilon_high; null: epsilon (DAPO recommends 0.28)."""
    loss_type: str = "dapo"
    """dapo (token losses over the completion tokens of the global batch) | grpo (each
    completion's mean, then the mean) | dr_grpo (over completions x max_new_tokens) | bnpo (over
    the tokens of each micro-batch)."""
    scale_rewards: str = "group"
    """group (advantages divided by the group's reward std) | batch (by the std of the whole
    batch) | none (Dr. GRPO: not divided)."""
    num_iterations: int = 1
    """Optimizer steps per generation (GRPO's mu, PPO's ppo_epochs): each batch of completions
    is trained on this many times, clipped against the log-probabilities it was sampled with."""
    bias_correction_kl: bool = True
    """Weigh the KL term of each token by pi / pi_old, the importance-sampling correction of the
    k3 estimator (TRL 1.16's use_bias_correction_kl, on by default); on-policy it changes the
    gradient, not the loss. false: beta * k3 alone."""
    mask_truncated_completions: bool = False
    """Leave completions that reached max_new_tokens without EOS out of the loss (DAPO)."""
    normalize_advantages: bool = False
    """rloo: normalise the advantages over the whole step (all ranks): less their mean, over
    their std (TRL's RLOOConfig.normalize_advantages)."""
    kl_coef: float = 0.05
    """ppo: the per-token KL penalty to the reference in the rewards (0: no reference held)."""
    vf_coef: float = 0.1
    """ppo: the value loss's weight beside the policy loss."""
    cliprange_value: float = 0.2
    """ppo: how far a value may move from the one it had when sampled, in the clipped loss."""
    gamma: float = 1.0
    """ppo: the discount of GAE."""
    lam: float = 0.95
    """ppo: the lambda of GAE."""


# TRL 1.16 GRPOConfig.loss_type values we have: tasks/rl/grpo_loss.py's LOSS_TYPES table, in this
# order (it asserts so)
LOSS_TYPE_NAMES = ("dapo", "grpo", "dr_grpo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")


def check_grpo(cfg: Any) -> None:
    """trainer.objective=grpo: `check_rl` with groups of two completions or more (a group's mean
    is the baseline)."""
    check_rl(cfg, min_generations=2)


def check_rloo(cfg: Any) -> None:
    """trainer.objective=rloo: `check_rl`; a leave-one-out baseline needs two completions."""
    check_rl(cfg, min_generations=2)


def check_ppo(cfg: Any) -> None:
    """trainer.objective=ppo: `check_rl`; one completion per prompt is enough (the value head is
    the baseline)."""
    check_rl(cfg, min_generations=1)


def check_rl(cfg: Any, min_generations: int) -> None:
    """rl.*: at least one reward, known loss and scaling names, sampling options in range;
    `min_generations`: the fewest completions per prompt the objective learns from."""
    r, objective = cfg.rl, cfg.task_spec.objective
    if not (r.reward_functions or r.reward_models):
        raise ConfigError(f"trainer.objective={objective} needs a reward: "
                          "rl.reward_functions=[module:function] (f(prompts, completions, "
                          "**kwargs) -> list[float]), Trainer(reward_functions=[f]), or "
                          "rl.reward_models=[DIR]")
    for folder in r.reward_models:
        _check_reward_model(folder)
    for name in r.reward_functions:
        module, _, attr = str(name).partition(":")
        if not (module and attr):
            raise ConfigError(f"rl.reward_functions: {name!r} is not module:function, e.g. "
                              "my_rewards:length_reward")
    n = len(r.reward_functions) + len(r.reward_models)
    if r.reward_weights is not None and len(r.reward_weights) != n:
        raise ConfigError(f"rl.reward_weights has {len(r.reward_weights)} weights for {n} "
                          "rewards (rl.reward_functions, then rl.reward_models); give one each, "
                          "or null")
    if cfg.trainer.tensor_parallel > 1:
        raise ConfigError(f"trainer.objective={objective} samples from whole weights: tensor "
                          "parallelism is not supported for it yet; use trainer.strategy=fsdp "
                          "(trainer.tensor_parallel=1)")
    if not cfg.data.drop_last:
        raise ConfigError("data.format=prompts trains on whole groups of completions: leave "
                          "data.drop_last=true")
    check_choice("rl.loss_type", r.loss_type, LOSS_TYPE_NAMES)
    check_choice("rl.scale_rewards", r.scale_rewards, SCALE_REWARDS)
    bounds = [("rl.num_generations", r.num_generations >= min_generations,
               f"at least {min_generations}" + (" (a group's mean is the baseline)"
                                                 if min_generations > 1 else "")),
              ("rl.max_new_tokens", r.max_new_tokens >= 1, "at least 1"),
              ("rl.temperature", r.temperature > 0, "positive"),
              ("rl.top_p", 0 < r.top_p <= 1, "in (0, 1]"),
              ("rl.top_k", r.top_k >= 0, "0 (off) or more"),
              ("rl.min_p", r.min_p is None or 0 <= r.min_p <= 1, "in [0, 1] or null"),
              ("rl.repetition_penalty", r.repetition_penalty > 0, "positive"),
              ("rl.beta", r.beta >= 0, "0 or more"),
              ("rl.epsilon", r.epsilon > 0, "positive"),
              ("rl.epsilon_high", r.epsilon_high is None or r.epsilon_high > 0, "positive"),
              ("rl.num_iterations", r.num_iterations >= 1, "at least 1"),
              ("rl.kl_coef", r.kl_coef >= 0, "0 or more"),
              ("rl.vf_coef", r.vf_coef >= 0, "0 or more"),
              ("rl.cliprange_value", r.cliprange_value > 0, "positive"),
              ("rl.gamma", 0 <= r.gamma <= 1, "in [0, 1]"),
              ("rl.lam", 0 <= r.lam <= 1, "in [0, 1]")]
    for key, ok, what in bounds:
        if not ok:
            raise ConfigError(f"{key}={_value(cfg, key)} must be {what}")


def _check_reward_model(folder: Any) -> None:
    """A folder with a config.json of a sequence-classification model (a reward run's model/);
    a causal LM (or any other head) is named as what it is."""
    config = Path(str(folder)).expanduser() / "config.json"
    if not config.is_file():
        raise ConfigError(f"rl.reward_models: {folder!r} is not a model folder with a "
                          "config.json; give a reward model's folder (a reward run's model/)")
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # unreadable: loading it says why, in the worker's words
    if architectures and not any(str(a).endswith("ForSequenceClassification")
                                 for a in architectures):
        kind = "a causal LM" if any(str(a).endswith("ForCausalLM") for a in architectures) \
            else "not a sequence-classification model"
        raise ConfigError(f"rl.reward_models: {folder} holds {', '.join(architectures)} "
                          f"({kind}), not a reward model; give a one-label sequence-"
                          "classification model's folder (what trainer.objective=reward writes "
                          "to its run's model/)")


def _value(cfg: Any, key: str) -> Any:
    return getattr(cfg.rl, key.split(".", 1)[1])
