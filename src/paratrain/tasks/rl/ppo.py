"""Online RL with PPO (`data.format=prompts`, `trainer.objective=ppo`), as TRL's PPOTrainer
(the 0.x one DataDreamer wraps; formulas in ppo_loss.py): the policy carries a value head, each
step samples completions of its prompts (the same sampling as GRPO: grpo.py, rollout.py), the
reward functions / models score each completion, a per-token KL penalty to the reference is
added, GAE turns rewards and values into advantages, and the clipped policy and value losses
train the policy and its value head together (rl.num_iterations passes per batch: TRL's
ppo_epochs).

The value head is a linear layer on the policy's last hidden state (TRL's
AutoModelForCausalLMWithValueHead), inside the one trained module (`PolicyWithValue`), so the
parallelism wraps, shards and snapshots it with the policy; model/ holds the policy alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch import nn

from ..base import NO_FROZEN, Frozen
from .grpo import GRPOTask
from .advantages import gae, step_moments, whiten
from .ppo_loss import PPOOptions, ppo_token_losses, token_rewards


class ValueHead(nn.Linear):
    """hidden (.., C) -> (.., 1): a class of its own, for FSDP to wrap."""


class PolicyWithValue(nn.Module):
    """A causal LM and a value head on its last hidden state: its output is the LM's, with
    `vpreds` (B, T) added (not `values`: ModelOutput has a values() method)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_head = ValueHead(policy.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)  # the same start on every rank, no seed needed
        nn.init.zeros_(self.value_head.bias)
        self._no_split_modules = getattr(policy, "_no_split_modules", None)  # its blocks

    def forward(self, **kwargs: Any) -> Any:
        out = self.policy(**kwargs, output_hidden_states=True)
        hidden = out.hidden_states[-1]  # (B, T, C)
        # a key, not an attribute: FSDP hooks the backward of the output's tensors (its pytree)
        out["vpreds"] = self.value_head(hidden.to(self.value_head.weight.dtype))[..., 0].clone()
        return out


@dataclass
class PPOTask(GRPOTask):
    """PPO on prompt records (module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ppo = PPOOptions.of(self.cfg.rl)
        self.unit_name = "completion tokens"

    @property
    def kl_coef(self) -> float:
        return self.cfg.rl.kl_coef

    def build_model(self) -> nn.Module:
        """The policy with its value head; FSDP shards the head as a unit of its own beside the
        blocks (in the root's group its weight was freed before backward reached it)."""
        from ...parallel.blocks import find_block_lists
        model = PolicyWithValue(super().build_model())
        blocks = {type(b) for layers in find_block_lists(model) for b in layers.children()}
        self.fsdp_wrap = (*blocks, ValueHead)
        return model

    def _advantages(self, model: nn.Module, batches: list, scored: list, env: Any,
                    amp: ContextManager, frozen: Frozen) -> list:
        """Old log-probs and values, the reference's log-probs, per-token rewards, GAE; the
        advantages whitened over the whole step (all ranks)."""
        out = []
        for b, per_fn in zip(batches, scored):
            if b is None:
                out.append(None)
                continue
            mask = b["completion_mask"].float()
            with torch.no_grad():
                old = self._logps(model, b, amp)
                ref = self._reference_logps(model, b, amp, frozen) if self.kl_coef else old.logps
            rewards = token_rewards(self.rewards.total(per_fn).to(mask.device), old.logps,
                                    ref, mask, self.kl_coef)
            advantages, returns = gae(rewards, old.values, mask, self.ppo.gamma, self.ppo.lam)
            out.append({**b, "old_logps": old.logps, "old_values": old.values * mask,
                        "ref_logps": ref, "advantages": advantages, "returns": returns,
                        "loss_mask": mask, "rewards": per_fn,
                        "truncated": ~(b["completion_ids"] == self.eos).any(dim=1)})
        kept = [b for b in out if b is not None]
        mean, var = step_moments(env, [(b["advantages"], b["loss_mask"]) for b in kept])
        for b in kept:
            b["advantages"] = whiten(b["advantages"], b["loss_mask"], mean, var)
        return out

    def count_units(self, batch: dict) -> int:
        return int(batch["loss_mask"].sum())

    def train_counts(self, model: nn.Module, batch: dict, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        """(the micro-batch's summed token losses, its completion tokens, sums for figures)."""
        now = self._logps(model, batch, amp, entropy=True)
        mask = batch["loss_mask"]
        loss, pg, vf = ppo_token_losses(now.logps, batch["old_logps"], batch["advantages"],
                                        now.values, batch["old_values"], batch["returns"],
                                        self.ppo)
        ratio = torch.exp(now.logps.detach() - batch["old_logps"])
        clipped = ((ratio - 1).abs() > self.ppo.epsilon).double()
        counts = {"tokens": mask.sum().double(),
                  "entropy": (now.entropy * mask).sum().double(),
                  "kl": ((batch["old_logps"] - batch["ref_logps"]) * mask).sum().double(),
                  "policy_loss": (pg.detach() * mask).sum().double(),
                  "value_loss": (vf.detach() * mask).sum().double(),
                  "clip_region": (clipped * mask).sum(),
                  "clip_low": torch.zeros((), dtype=torch.float64),
                  "clip_high": torch.zeros((), dtype=torch.float64)}
        return (loss * mask).sum(), int(mask.sum()), counts

    def train_metrics(self, counts: dict) -> dict:
        out = super().train_metrics(counts)
        tokens = counts.get("tokens", 0.0)
        if tokens:
            out.update({"loss/policy": counts["policy_loss"] / tokens,
                        "loss/value": counts["value_loss"] / tokens})
        for side in ("low", "high"):
            out.pop(f"clip_ratio/{side}_mean", None)
        return out

    def describe(self, n_params: int) -> str:
        rl = self.cfg.rl
        return (f"PPO (value head, kl_coef {rl.kl_coef}, {self.group} completions per "
                f"prompt) on " + super().describe(n_params).split(" on ", 1)[1])

    def save(self, model: nn.Module, out_dir: Path, state: dict) -> None:
        """model/ holds the policy alone (a causal LM folder `generate` and transformers read)."""
        policy_state = {k[len("policy."):]: v for k, v in state.items()
                        if k.startswith("policy.")}
        if self.lora:
            from ..lora import ADAPTER_DIR
            fresh = GRPOTask.build_model(self)  # the policy alone, to hold its state
            fresh.load_state_dict(policy_state)
            self.save_lora(fresh, merged=out_dir, adapter=out_dir.parent / ADAPTER_DIR)
            return
        super().save(model.policy, out_dir, policy_state)
