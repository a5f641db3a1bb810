"""What the `rl` section (online RL, tasks/grpo.py) may hold, checked when a config is built,
torch-free: one line naming the key and a value that works. Whether each reward function can be
imported is checked by the task before any worker starts (importing may need torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError, check_choice

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")  # TRL 1.16 GRPOConfig.loss_type values we have
SCALE_REWARDS = ("group", "batch", "none")


def check_rl(cfg: Any) -> None:
    """rl.*: at least one reward, known loss and scaling names, sampling options in range."""
    r, objective = cfg.rl, cfg.task.objective
    if not (r.reward_functions or r.reward_models):
        raise ConfigError(f"trainer.objective={objective} needs a reward: "
                          "rl.reward_functions=[module:function] (f(prompts, completions) -> "
                          "list[float]), Trainer(reward_functions=[f]), or rl.reward_models=[DIR]")
    for folder in r.reward_models:
        if not (Path(str(folder)).expanduser() / "config.json").is_file():
            raise ConfigError(f"rl.reward_models: {folder!r} is not a model folder with a "
                              "config.json; give a reward model's folder (a reward run's "
                              "model/)")
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
    if not cfg.data.drop_last:
        raise ConfigError("data.format=prompts trains on whole groups of completions: leave "
                          "data.drop_last=true")
    check_choice("rl.loss_type", r.loss_type, LOSS_TYPES)
    check_choice("rl.scale_rewards", r.scale_rewards, SCALE_REWARDS)
    ppo = objective == "ppo"
    bounds = [("rl.num_generations", r.num_generations >= (1 if ppo else 2),
               "at least 1" if ppo else "at least 2 (a group's mean is the baseline)"),
              ("rl.max_new_tokens", r.max_new_tokens >= 1, "at least 1"),
              ("rl.temperature", r.temperature > 0, "positive"),
              ("rl.top_p", 0 < r.top_p <= 1, "in (0, 1]"),
              ("rl.top_k", r.top_k >= 0, "0 (off) or more"),
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


def _value(cfg: Any, key: str) -> Any:
    return getattr(cfg.rl, key.split(".", 1)[1])
