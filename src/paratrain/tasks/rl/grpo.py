"""Online RL with GRPO (`data.format=prompts`, `trainer.objective=grpo`; DeepSeekMath's Group
Relative Policy Optimization, as TRL 1.16's GRPOTrainer): each step, the policy samples
rl.num_generations completions of each prompt, the reward functions score them, each
completion's advantage is its reward relative to its group's, and the policy learns from its
own samples with the clipped surrogate and, when rl.beta > 0, a KL penalty to a reference.

The loop runs a step in two parts: `rollout` turns the step's prompts into scored completions
(generation and scoring, timed apart), then the usual micro-steps run `train_counts` on them
(the loss: grpo_loss.py). A prompt is one sample: its group of completions never leaves its
rank, so advantages need no communication, and 1 and N workers sample the same completions
(rollout.py seeds each prompt's generator by the step and its index). With data.pack=true the
learning pass (and the old / reference log-probs) runs on packed rows (packed_pass.py).

The reference (rl.beta > 0): a frozen copy of model.path placed and sharded like the policy;
with LoRA, the policy with its adapters off (no second copy). rl.num_iterations > 1 trains on
each batch of completions that many steps, clipped against the log-probabilities they were
sampled with; the data advances one batch per rl.num_iterations steps (`steps_per_batch`), so
every prompt is used, as TRL repeats its batches (an epoch is that many times the steps). A run
resumed between two iterations samples its batch again (the completions are not snapshotted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Optional

import torch
from torch import nn

from ...formatting import human_count
from ..base import NO_FROZEN, Frozen, MemoryProbe, to_device
from .grpo_loss import LossOptions, clip_counts, loss_units, reduce_loss, token_terms
from ..finetuning import Encoder
from .advantages import group_relative
from .rewards import Rewards
from .rollout import (
    Sampling,
    TokenScores,
    completion_logps,
    prompt_generator,
    sample_completions,
    unwrapped,
)
from ..sft import CausalLMTask


@dataclass
class GRPOTask(CausalLMTask):
    """GRPO on prompt records (module docstring)."""
    sample_name: ClassVar[str] = "prompts"
    perplexity: ClassVar[bool] = False
    units_per_sample: ClassVar[Optional[int]] = None  # completion tokens vary: counted per step
    progress_keys: ClassVar[tuple[str, ...]] = (  # on the progress bar, beside loss and lr
        "reward", "time/generation_s", "time/scoring_s", "time/learning_s")
    rewards: Optional[Rewards] = None
    _cached: list = field(default_factory=list)  # rl.num_iterations: the batch trained again
    _all_done: Callable[[bool], bool] = bool  # when generation may stop (`_lockstep`)

    def __post_init__(self) -> None:
        rl = self.cfg.rl
        self.group = rl.num_generations  # completions per prompt: read here only
        self.rewards = self.rewards or Rewards.of(rl)
        self.sampling, self.options = Sampling.of(rl), LossOptions.of(rl)
        self.unit_name = "completion tokens" if rl.loss_type == "dapo" else "completions"

    @property
    def steps_per_batch(self) -> int:
        """rl.num_iterations: the loop trains that many steps on each batch of prompts."""
        return self.cfg.rl.num_iterations

    @property
    def kl_coef(self) -> float:
        """The KL penalty's coefficient (rl.beta); the reference is held when it is not 0."""
        return self.cfg.rl.beta

    @classmethod
    def encoder(cls, cfg: Any, tokenizer: Any, notes: list) -> Encoder:
        return _PromptEncoder(cfg, tokenizer, notes)

    def arrange(self, log: Callable[[str], None]) -> None:
        """The prompts are not packed (sampling reads them padded); data.pack=true packs the
        learning pass, and the log says so."""
        super().arrange(log)
        if self.cfg.data.pack:
            log(f"data.pack: the learning pass packs each prompt and its completion into rows "
                f"of up to {self.cfg.max_length} tokens (data.max_length); sampling stays "
                f"padded, and trainer.batch_size counts prompts")

    @classmethod
    def dataset(cls, examples: list) -> Any:
        from .prompts import PromptDataset
        return PromptDataset(examples)

    @property
    def collate(self) -> Callable[[list], Any]:
        from .prompts import PromptCollate
        return PromptCollate(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id
                             is not None else self.eos)

    @classmethod
    def check_fits(cls, cfg: Any, tokenizer: Any) -> None:
        """Room for a prompt and rl.max_new_tokens within the model's positions."""
        from ...errors import ConfigError
        super().check_fits(cfg, tokenizer)
        if cfg.max_length - cfg.rl.max_new_tokens < 1:
            raise ConfigError(f"rl.max_new_tokens={cfg.rl.max_new_tokens} leaves no room for a "
                              f"prompt within {cfg.max_length} tokens (data.max_length, or the "
                              "model's positions); lower rl.max_new_tokens")

    @property
    def eos(self) -> int:
        from ...data.hf_tokenizer import eos_id
        return eos_id(self.tokenizer)

    def build_frozen(self) -> dict[str, nn.Module]:
        """The reward models (rl.reward_models), and the reference when rl.beta > 0 and no LoRA
        (whose adapters switch off instead)."""
        from .reward_models import load_reward_model, reward_model_key
        frozen = {reward_model_key(i): load_reward_model(folder,
                                                         self.cfg.model.trust_remote_code)
                  for i, folder in enumerate(self.cfg.rl.reward_models)}
        if self.kl_coef != 0.0 and not self.lora:
            from ...models.hf import HFArgs, build_hf
            torch.manual_seed(self.cfg.trainer.seed)
            frozen["reference"] = build_hf(HFArgs.of(self.cfg.model, len(self.tokenizer),
                                                     quantized=False))
            if self.cfg.data.pack:  # it scores the same packed rows as the policy
                from ...models.hf import check_packed_attention, use_packed_attention
                use_packed_attention(frozen["reference"])
                check_packed_attention(frozen["reference"])
        return frozen

    def memory_probe(self) -> Optional[MemoryProbe]:
        """For `paratrain plan` and auto: memory.py."""
        from ..probe import causal_probe
        from .memory import FrozenProbe, GenerationCache
        rl = self.cfg.rl
        reference = self.kl_coef != 0.0 and not self.lora
        return causal_probe(self.cfg, self.train_ds.longest + rl.max_new_tokens,
                            len(self.tokenizer), rows=self.group,
                            build_frozen=FrozenProbe(self.cfg, reference)
                            if reference or rl.reward_models else None,
                            cache=GenerationCache.of(self.cfg, self.train_ds.longest))

    # ---- a step's completions -------------------------------------------------------------
    def rollout(self, model: nn.Module, micro: list, step: int, env: Any, amp: ContextManager,
                frozen: Frozen = NO_FROZEN) -> tuple[list, dict]:
        """The step's prompt micro-batches -> the same number of batches of scored completions
        (None stays None), and this rank's figures of them (summed by the loop like the loss)."""
        if self._cached and step % self.cfg.rl.num_iterations:
            return self._cached, _zero(self._figures)
        self._all_done = _lockstep(model, env)
        t0 = time.perf_counter()
        batches = [self._sample(model, mb, step, env.device, amp) if mb is not None else None
                   for mb in micro]
        t1 = time.perf_counter()
        scored = [self._score(b, frozen, env.device, amp, step) if b is not None else None
                  for b in batches]
        t2 = time.perf_counter()
        out = self._advantages(model, batches, scored, env, amp, frozen)
        figures = self._rollout_figures(env, [s for s in scored if s is not None],
                                        [b for b in out if b is not None])
        figures.update({"generation_s": t1 - t0, "scoring_s": t2 - t1, "rank_steps": 1.0})
        if self.cfg.rl.num_iterations > 1:
            self._cached, self._figures = out, figures
        return out, figures

    def _sample(self, model: nn.Module, mb: dict, step: int, device: torch.device,
                amp: ContextManager) -> dict:
        prompt_ids, prompt_mask = to_device(mb["prompt_ids"], device), \
            to_device(mb["prompt_mask"], device)
        seed = self.cfg.trainer.seed
        gens = [prompt_generator(seed, step, int(i)) for i in mb["index"]]
        G = self.group
        completion, mask = sample_completions(unwrapped(model), prompt_ids, prompt_mask, gens, G,
                                              self.sampling, self.eos, self.collate.pad_id, amp,
                                              self._all_done)
        return {"prompt_ids": prompt_ids.repeat_interleave(G, 0),
                "prompt_mask": prompt_mask.repeat_interleave(G, 0),
                "completion_ids": completion, "completion_mask": mask,
                "prompts": [p for p in mb["prompts"] for _ in range(G)],
                "fields": [f for f in mb.get("fields", [{}] * len(mb["prompts"]))
                           for _ in range(G)]}

    def _score(self, b: dict, frozen: Frozen, device: torch.device, amp: ContextManager,
               step: int) -> torch.Tensor:
        """(N, F) each reward's score of each completion (NaN: a function's None)."""
        ids = b["completion_ids"].masked_fill(b["completion_mask"] == 0, self.collate.pad_id)
        texts = self.tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)
        completion_ids = [row[:int(n)] for row, n in zip(b["completion_ids"].tolist(),
                                                          b["completion_mask"].sum(-1))]
        return self.rewards.score(b["prompts"], texts, frozen, device, amp, fields=b["fields"],
                                  step=step, completion_ids=completion_ids)

    def _advantages(self, model: nn.Module, batches: list, scored: list, env: Any,
                    amp: ContextManager, frozen: Frozen) -> list:
        """Each batch with its advantages and what its loss needs (group-relative: GRPO)."""
        batch_std = self._batch_std(env, scored) if self.cfg.rl.scale_rewards == "batch" else None
        return [self._finish(model, b, s, amp, frozen, batch_std) if b is not None else None
                for b, s in zip(batches, scored)]

    def _batch_std(self, env: Any, scored: list) -> float:
        """rl.scale_rewards=batch: the std of every reward of the step, over all ranks."""
        r = torch.cat([self.rewards.total(s) for s in scored if s is not None])
        n, s1, s2 = env.all_reduce_sum([float(r.numel()), float(r.sum()),
                                        float((r * r).sum())]).tolist()
        return max(s2 - s1 * s1 / n, 0.0) ** 0.5 / max(n - 1, 1.0) ** 0.5

    def _finish(self, model: nn.Module, b: dict, per_fn: torch.Tensor, amp: ContextManager,
                frozen: Frozen, batch_std: Optional[float]) -> dict:
        """Advantages, the mask the loss counts, and the old / reference log-probs it needs."""
        rl, dev = self.cfg.rl, b["completion_ids"].device
        total = self.rewards.total(per_fn)  # (N,)
        if batch_std is None:
            advantages = group_relative(total, self.group, rl.scale_rewards)
        else:
            advantages = group_relative(total, self.group, "none") / (batch_std + 1e-4)
        mask = b["completion_mask"]
        truncated = ~(b["completion_ids"] == self.eos).any(dim=1)  # (N,) no EOS: cut short
        if rl.mask_truncated_completions:
            mask = mask * (~truncated)[:, None]
        b = {**b, "advantages": advantages.float().to(dev), "loss_mask": mask,
             "rewards": per_fn, "truncated": truncated}
        with torch.no_grad():
            if rl.num_iterations > 1:
                b["old_logps"] = self._logps(model, b, amp).logps
            if rl.beta != 0.0:
                b["ref_logps"] = self._reference_logps(model, b, amp, frozen)
        return b

    def _logps(self, model: nn.Module, b: dict, amp: ContextManager, entropy: bool = False
               ) -> TokenScores:
        """(N, C) per completion token; on packed rows with data.pack=true (packed_pass.py)."""
        if self.cfg.data.pack:
            from .packed_pass import packed_completion_logps
            return packed_completion_logps(
                model, b["prompt_ids"], b["prompt_mask"], b["completion_ids"],
                b["completion_mask"], self.sampling.temperature, amp, int(self.cfg.max_length),
                entropy)
        return completion_logps(model, b["prompt_ids"], b["prompt_mask"], b["completion_ids"],
                                b["completion_mask"], self.sampling.temperature, amp, entropy)

    def _reference_logps(self, model: nn.Module, b: dict, amp: ContextManager,
                         frozen: Frozen) -> torch.Tensor:
        if self.lora:
            from ..lora import adapters_of
            peft_model = adapters_of(model)
            with peft_model.disable_adapter():
                return self._logps(peft_model, b, amp).logps
        return self._logps(frozen["reference"], b, amp).logps

    def eval_counts(self, model: nn.Module, batch: dict, device: torch.device,
                    amp: ContextManager, frozen: Frozen = NO_FROZEN
                    ) -> tuple[torch.Tensor, int, dict]:
        """Held-out prompts: completions sampled as in training (seeded by the prompt alone),
        scored; the "loss" is minus their mean reward (so the best evaluation is the highest
        reward), val_reward its opposite."""
        b = self._sample(model, batch, -1, device, amp)
        total = self.rewards.total(self._score(b, frozen, device, amp, -1))  # (N,)
        return -total.sum(), int(total.numel()), {"reward": float(total.sum()),
                                                  "completions": float(total.numel())}

    def eval_metrics(self, counts: dict) -> dict:
        n = counts.get("completions", 0.0)
        return {"val_reward": counts["reward"] / n} if n else {}

    # ---- the loss -------------------------------------------------------------------------
    def count_units(self, batch: dict) -> int:
        return loss_units(batch["loss_mask"], self.cfg.rl.loss_type)

    def loss(self, model: nn.Module, batch: dict, device: torch.device, amp: ContextManager,
             frozen: Frozen = NO_FROZEN) -> tuple[torch.Tensor, int]:
        s, n, _ = self.train_counts(model, batch, device, amp, frozen)
        return s, n

    def train_counts(self, model: nn.Module, batch: dict, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        """(the micro-batch's loss sum, its units, sums for the figures): grpo_loss.py."""
        logps, entropy, _ = self._logps(model, batch, amp, entropy=True)  # (N, C) each
        old = batch.get("old_logps", logps.detach())
        terms = token_terms(logps, old, batch.get("ref_logps"), batch["advantages"],
                            self.options)
        mask = batch["loss_mask"]
        s, n = reduce_loss(terms.loss, mask, self.options)
        counts = {"tokens": mask.sum().double(), "entropy": (entropy * mask).sum().double(),
                  **clip_counts(terms, batch["advantages"], mask, self.options)}
        if terms.kl is not None:
            counts["kl"] = (terms.kl.detach() * mask).sum().double()
        return s, n, counts

    def _rollout_figures(self, env: Any, scored: list, batches: list) -> dict:
        """Sums of this rank's rewards and lengths; the step's shortest and longest completion
        over all ranks, held by rank 0 (every rank holds the same keys)."""
        per_fn = torch.cat(scored) if scored else torch.zeros(0, len(self.rewards.labels))
        total = self.rewards.total(per_fn)  # (N,)
        lengths = torch.cat([b["completion_mask"].sum(-1) for b in batches]).double() \
            if batches else torch.zeros(0)
        G = self.group
        out = {"completions": float(total.numel()), "reward": float(total.sum()),
               "reward_sq": float((total * total).sum()),
               "length": float(lengths.sum()),
               "truncated": float(sum(int(b["truncated"].sum()) for b in batches)),
               "zero_std_groups": float((total.view(-1, G).std(dim=1) < 1e-8).sum())
               if total.numel() and G > 1 else 0.0,
               "groups": float(total.numel() // G)}
        for j, label in enumerate(self.rewards.labels):  # None (NaN) left out, as TRL's nanmean
            out[f"fn/{label}"] = float(per_fn[:, j].nansum())
            out[f"fn_sq/{label}"] = float((per_fn[:, j] ** 2).nansum())
            out[f"fn_n/{label}"] = float((~per_fn[:, j].isnan()).sum())
        longest = env.max_over_ranks(float(lengths.max()) if lengths.numel() else 0.0)
        shortest = -env.max_over_ranks(-float(lengths.min()) if lengths.numel() else -1e9)
        master = 1.0 if env.is_master else 0.0
        out.update({"max_length": longest * master, "min_length": shortest * master,
                    "steps": master})
        return out

    def train_metrics(self, counts: dict) -> dict:
        """TRL's names: reward, reward_std, rewards/<f>/mean and /std, kl, entropy,
        clip_ratio/*, completions/*, frac_reward_zero_std; the time split of a step."""
        from .grpo_metrics import grpo_metrics
        return grpo_metrics(counts, self.rewards.labels)

    def describe(self, n_params: int) -> str:
        rl = self.cfg.rl
        return (f"GRPO ({rl.loss_type} loss, {self.group} completions per prompt, "
                f"beta {rl.beta}) on model hf ({self.cfg.model.path}): {human_count(n_params)} "
                f"parameters; rewards: {', '.join(self.rewards.names + self.rewards.models)}; "
                f"tokenizer {self.tokenizer_dir} ({len(self.tokenizer)} tokens)")


def _lockstep(model: nn.Module, env: Any) -> Callable[[bool], bool]:
    """When this rank may stop sampling: when it is done, unless the model is sharded (FSDP /
    HSDP gather each block's weights in every forward): then when every rank is done."""
    from torch.distributed.fsdp import FSDPModule
    if not (env.distributed and any(isinstance(m, FSDPModule) for m in model.modules())):
        return bool
    return lambda done: env.max_over_ranks(0.0 if done else 1.0) == 0.0


def _zero(figures: dict) -> dict:
    """The figures of a step that trains on the batch of an earlier one: nothing sampled."""
    return {**{k: 0.0 for k in figures}, "rank_steps": 1.0}


class _PromptEncoder(Encoder):
    """tasks/rl/prompts.py's encoder with the config's fields and room."""

    def __init__(self, cfg: Any, tokenizer: Any, notes: list):
        self.cfg, self.tokenizer, self.notes = cfg, tokenizer, notes

    def __call__(self, rows: list, source_name: str) -> list:
        from .prompts import encode_prompts
        d = self.cfg.data
        examples, note = encode_prompts(
            rows, self.tokenizer, field=d.prompt_field, chat_template=d.chat_template,
            system_prompt=d.system_prompt, room=self.cfg.max_length - self.cfg.rl.max_new_tokens,
            source_name=source_name)
        self.notes.append(note)
        return examples
