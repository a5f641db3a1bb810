"""GRPO's logged figures, under TRL 1.16 GRPOTrainer's names, from the sums the loop adds up
over micro-steps, ranks and the log window (grpo.py's `rollout` and `train_counts`)."""

from __future__ import annotations

import math


def _std(s1: float, s2: float, n: float) -> float:
    """The unbiased standard deviation of n values from their sum and sum of squares."""
    return math.sqrt(max(s2 - s1 * s1 / n, 0.0) / (n - 1)) if n > 1 else 0.0


def grpo_metrics(c: dict, reward_names: list[str]) -> dict:
    """reward, reward_std, rewards/<f>/mean and /std, frac_reward_zero_std, completions/*,
    entropy, kl, clip_ratio/*; time/generation_s, scoring_s (per step, the mean over ranks)."""
    n, tokens = c.get("completions", 0.0), c.get("tokens", 0.0)
    out: dict = {}
    if n:
        out.update({"reward": c["reward"] / n, "reward_std": _std(c["reward"],
                                                                    c["reward_sq"], n)})
        for f in reward_names:  # over the completions it scored (None: not)
            scored = c.get(f"fn_n/{f}", n)
            out[f"rewards/{f}/mean"] = c[f"fn/{f}"] / scored if scored else math.nan
            out[f"rewards/{f}/std"] = _std(c[f"fn/{f}"], c[f"fn_sq/{f}"], scored)
        out.update({"frac_reward_zero_std": c["zero_std_groups"] / max(c["groups"], 1.0),
                    "completions/mean_length": c["length"] / n,
                    "completions/clipped_ratio": c["truncated"] / n})
    steps = c.get("steps", 0.0)
    if steps:  # rank 0's per-step extremes, averaged over the window's steps (as TRL logs)
        out.update({"completions/min_length": c["min_length"] / steps,
                    "completions/max_length": c["max_length"] / steps})
    if tokens:
        out["entropy"] = c["entropy"] / tokens
        if "kl" in c:
            out["kl"] = c["kl"] / tokens
        for side in ("low", "high", "region"):
            out[f"clip_ratio/{side}_mean"] = c[f"clip_{side}"] / tokens
    rank_steps = c.get("rank_steps", 0.0)
    if rank_steps:
        for part in ("generation", "scoring", "learning"):
            if f"{part}_s" in c:
                out[f"time/{part}_s"] = c[f"{part}_s"] / rank_steps
    return out
