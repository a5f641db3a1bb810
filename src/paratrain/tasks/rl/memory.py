"""What `paratrain plan` (and strategy auto) measures of an online RL run (grpo.py, ppo.py) beside
the policy (tasks/probe.py: with its LoRA adapters, on a prompt's rl.num_generations rows of the
longest prompt + rl.max_new_tokens tokens): the frozen models it holds, the reference (when the KL
coefficient is not 0 and there is no LoRA) and each reward model, built from their configs (no
weights read); and generation's KV cache (`GenerationCache`), counted from the model's config:
held while the policy samples, freed before the training forward of the same rows, so the plan's
peak holds the larger of the two."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ...models.hf import hf_config, remote_code


@dataclass(frozen=True)
class GenerationCache:
    """The KV cache of one micro-batch's generation (rollout.py samples a micro-batch's
    completions at once): a key and a value per layer, row and token, of KV heads x head size,
    for rows = prompts x rl.num_generations and tokens = the longest prompt + rl.max_new_tokens,
    in the dtype the forward computes in (bf16 under mixed precision)."""
    layers: int
    kv_heads: int
    head_dim: int
    generations: int  # rows per prompt
    prompt_tokens: int
    new_tokens: int
    dtype_bytes: int

    @classmethod
    def of(cls, cfg: Any, prompt_tokens: int) -> "GenerationCache":
        config = hf_config(cfg.model.path, cfg.model.trust_remote_code)
        text = config.get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads,
                   head_dim, cfg.rl.num_generations, prompt_tokens, cfg.rl.max_new_tokens,
                   4 if cfg.trainer.precision == "fp32" else 2)

    def bytes(self, prompts: int) -> int:
        """Bytes on a device generating for `prompts` prompts at once."""
        return (self.layers * 2 * prompts * self.generations
                * (self.prompt_tokens + self.new_tokens) * self.kv_heads * self.head_dim
                * self.dtype_bytes)

    def describe(self, prompts: int) -> str:
        return (f"{self.layers} layers x 2 (key, value) x {prompts * self.generations} rows "
                f"({prompts} prompts x {self.generations} generations) x "
                f"{self.prompt_tokens + self.new_tokens} tokens ({self.prompt_tokens} prompt + "
                f"{self.new_tokens} new) x {self.kv_heads} KV heads x {self.head_dim} head size "
                f"x {self.dtype_bytes} bytes")


class FrozenProbe:
    """The frozen models' factory: the reference and the reward models, from their configs."""

    def __init__(self, cfg: Any, reference: bool):
        self.cfg, self.reference = cfg, reference

    def __call__(self) -> dict[str, nn.Module]:
        import transformers

        from .reward_models import reward_model_key
        trust = self.cfg.model.trust_remote_code
        out = {reward_model_key(i): transformers.AutoModelForSequenceClassification.from_config(
            hf_config(folder, trust), **remote_code(trust))
            for i, folder in enumerate(self.cfg.rl.reward_models)}
        if self.reference:
            out["reference"] = transformers.AutoModelForCausalLM.from_config(
                hf_config(self.cfg.model.path, trust), **remote_code(trust))
        return out
