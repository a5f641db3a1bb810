"""GRPO's pieces in one process, on tiny tensors: the loss and its gradient against TRL 1.16's
own GRPOTrainer._compute_loss on the same log-probs, advantages and masks (every loss type we
offer, with clipping and the KL term active); the group advantages against TRL's formula; a
prompt's completions independent of the batch it is sampled in (what makes 1 and N workers
sample the same); the plan's generation KV cache against the cache one real generation holds;
a reward function that fails names itself in one line; config refusals."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from paratrain.errors import TrainingError
from paratrain.tasks.rl.grpo_loss import LossOptions, reduce_loss, token_terms
from paratrain.tasks.rl.advantages import group_relative as group_advantages
from paratrain.tasks.rl.rewards import Rewards
from tests.conftest import cli_error

N, C = 6, 7  # completions, completion tokens


def _tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(N, C, generator=g, dtype=torch.float64) * 3  # (N, C)
    mask = torch.ones(N, C, dtype=torch.float64)
    for row, length in enumerate([7, 3, 5, 1, 6, 4]):
        mask[row, length:] = 0
    return {"logps": logps,
            # the policy moved since sampling (num_iterations > 1): ratios past the clip
            "old": logps + torch.randn(N, C, generator=g, dtype=torch.float64) * 0.4,
            "ref": logps + torch.randn(N, C, generator=g, dtype=torch.float64) * 0.3,
            "advantages": torch.randn(N, generator=g, dtype=torch.float64), "mask": mask}


def _trl_loss(t: dict, logps: torch.Tensor, o: LossOptions) -> torch.Tensor:
    """TRL 1.16's GRPOTrainer._compute_loss, run as it is on an object holding the attributes it
    reads; the model's per-token log-probs are `logps` (what its forward would return)."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps),
                                                             None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=o.beta, loss_type=o.loss_type,
        epsilon_low=o.epsilon, epsilon_high=o.high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=o.max_new_tokens,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        args=types.SimpleNamespace(use_bias_correction_kl=o.bias_correction_kl, delta=None,
                                   steps_per_generation=1),
        accelerator=types.SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x,
                                          gather=lambda x: x))
    mask = t["mask"].long()
    inputs = {"prompt_ids": torch.zeros(N, 2, dtype=torch.long),
              "prompt_mask": torch.ones(N, 2, dtype=torch.long),
              "completion_ids": torch.zeros(N, C, dtype=torch.long), "completion_mask": mask,
              "advantages": t["advantages"], "old_per_token_logps": t["old"],
              "ref_per_token_logps": t["ref"], "num_items_in_batch": mask.sum()}
    return trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)


def _trl_default_bias_correction() -> bool:
    trl = pytest.importorskip("trl")
    return trl.GRPOConfig.__dataclass_fields__["use_bias_correction_kl"].default


def test_the_kl_correction_is_on_by_default_as_in_trl():
    """rl.bias_correction_kl defaults to TRL's use_bias_correction_kl default (true in 1.16)."""
    from paratrain.config.rl import RLConfig
    assert RLConfig().bias_correction_kl is _trl_default_bias_correction() is True
    assert LossOptions.of(RLConfig()).bias_correction_kl is True


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("correction", [True, False], ids=["trl-default", "no-correction"])
def test_loss_and_gradient_equal_trls(loss_type, correction):
    """One micro-batch on one process: TRL's loss is our sum over our units; the gradients with
    respect to the policy's log-probs agree too (within 1e-6; both in float64); with TRL's
    default KL correction and without it."""
    t = _tensors()
    o = LossOptions(loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28, max_new_tokens=C + 1,
                    bias_correction_kl=correction)
    ours_in = t["logps"].clone().requires_grad_()
    terms = token_terms(ours_in, t["old"], t["ref"], t["advantages"], o)
    s, units = reduce_loss(terms.loss, t["mask"], o)
    ours = s / units
    ours.backward()
    theirs_in = t["logps"].clone().requires_grad_()
    theirs = _trl_loss(t, theirs_in, o)
    theirs.backward()
    clipped = ((terms.ratio < 0.8) | (terms.ratio > 1.28)) & (t["mask"] > 0)
    assert clipped.any() and (~clipped & (t["mask"] > 0)).any()  # both sides of the clip run
    error = abs(float((ours - theirs).detach()))
    assert error <= 1e-6, (float(ours.detach()), float(theirs.detach()))
    assert torch.allclose(ours_in.grad, theirs_in.grad, rtol=0, atol=1e-6)
    assert float(ours_in.grad.abs().sum()) > 0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_on_policy_the_correction_moves_the_gradient_not_the_loss(loss_type):
    """On-policy (old = the policy's own log-probs, detached: rl.num_iterations=1) TRL's default
    loss equals the uncorrected one, but its gradient differs; ours follows TRL's default."""
    t = _tensors()
    grads = []
    for correction in (True, False):
        o = LossOptions(loss_type, beta=0.04, max_new_tokens=C + 1, bias_correction_kl=correction)
        ours_in = t["logps"].clone().requires_grad_()
        terms = token_terms(ours_in, ours_in.detach(), t["ref"], t["advantages"], o)
        s, units = reduce_loss(terms.loss, t["mask"], o)
        (s / units).backward()
        theirs_in = t["logps"].clone().requires_grad_()
        theirs = _trl_loss({**t, "old": None}, theirs_in, o)
        theirs.backward()
        assert abs(float((s / units - theirs).detach())) <= 1e-6
        assert torch.allclose(ours_in.grad, theirs_in.grad, rtol=0, atol=1e-6)
        grads.append(ours_in.grad)
    assert (grads[0] - grads[1]).abs().max() > 1e-4


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_are_trls(scale):
    """TRL 1.16 grpo_trainer.py, _generate_and_score_completions (sum_then_normalize, lines
    2759-2787): rewards less the group mean, divided by nanstd (+1e-4) of the group or the batch,
    or not at all. In float32, as TRL's rewards are (its Bessel factor count / (count - 1) is
    float32 whatever the rewards' dtype)."""
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    G = 4
    rewards = torch.tensor([0.1, 0.5, 0.2, 0.9, 1.0, 1.0, 0.0, 0.3])
    mean = rewards.view(-1, G).mean(dim=1).repeat_interleave(G)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G) if scale != "batch" else \
        nanstd(rewards).expand_as(rewards)
    expected = rewards - mean
    if scale != "none":
        expected = expected / (std + 1e-4)
    assert torch.allclose(group_advantages(rewards, G, scale), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("extra", [{}, {"min_p": 0.05, "repetition_penalty": 1.3}],
                         ids=["top-p-k", "min-p-repetition"])
def test_a_prompts_completions_do_not_depend_on_its_batch(tmp_path, extra):
    """The same prompt, step and index give the same completions whether sampled alone or
    beside other (longer, so left-padded) prompts: what 1 and N workers rely on (with
    repetition_penalty too: pads are not penalised)."""
    transformers = pytest.importorskip("transformers")
    from paratrain.tasks.rl.rollout import Sampling, prompt_generator, sample_completions
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    how = Sampling(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=20, **extra)
    short = torch.tensor([[5, 6, 7]])  # alone; then beside [1, 2, 3, 4, 5, 6, 8]
    alone, alone_mask = sample_completions(model, short, torch.ones_like(short),
                                           [prompt_generator(1, 3, 11)], 3, how, 0, 0)
    both = torch.tensor([[0, 0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8]])
    mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [1] * 7])
    together, together_mask = sample_completions(
        model, both, mask, [prompt_generator(1, 3, 11), prompt_generator(1, 3, 12)], 3, how, 0, 0)
    n = alone.size(1)
    assert torch.equal(together[:3, :n] * together_mask[:3, :n], alone * alone_mask)
    again, _ = sample_completions(model, short, torch.ones_like(short),
                                  [prompt_generator(1, 4, 11)], 3, how, 0, 0)
    assert not torch.equal(again, alone)  # another step draws others


class _KeepsCache(torch.nn.Module):
    """The model, keeping the KV cache of its last forward (what generation holds at its end)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.cache = model, None

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        self.cache = out.cache if getattr(out, "cache", None) is not None \
            else out.past_key_values
        return out


def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values))


def test_the_plans_generation_cache_is_what_a_generation_holds(hf_llama, tmp_path):
    """GenerationCache (what `paratrain plan` counts per device) grows with rl.num_generations
    and rl.max_new_tokens as the formula says, and equals, within 1/(prompt + new tokens), the
    cache of one real generation of the tiny model (2 layers, 2 KV heads of 16; the last token
    sampled is never fed back, so the real cache is one token shorter)."""
    transformers = pytest.importorskip("transformers")
    from paratrain.config.tree import TrainConfig
    from paratrain.tasks.rl.memory import GenerationCache
    from paratrain.tasks.rl.rollout import Sampling, prompt_generator, sample_completions

    def planned(generations: int, new: int, prompts: int = 2, prompt_tokens: int = 6) -> int:
        cfg = TrainConfig.from_yaml(None, [
            "model.arch=hf", f"model.path={hf_llama}", "data.format=prompts",
            f"data.source={tmp_path / 'p.jsonl'}", "rl.reward_functions=[a:b]",
            f"rl.num_generations={generations}", f"rl.max_new_tokens={new}"])
        return GenerationCache.of(cfg, prompt_tokens).bytes(prompts)

    base = planned(4, 10)
    assert base == 2 * 2 * (2 * 4) * (6 + 10) * 2 * 16 * 4  # layers x K,V x rows x T x H x D x 4
    assert planned(8, 10) == 2 * base and planned(4, 26) == 2 * base
    model = _KeepsCache(transformers.AutoModelForCausalLM.from_pretrained(hf_llama))
    prompts = torch.randint(0, 300, (2, 6))  # (B, P)
    completions, _ = sample_completions(
        model, prompts, torch.ones_like(prompts), [prompt_generator(0, 0, i) for i in (0, 1)],
        4, Sampling(max_new_tokens=10), eos_id=-1, pad_id=0)  # no EOS: all 10 tokens
    assert completions.shape == (8, 10)
    measured = _cache_bytes(model.cache)
    assert abs(measured - base) <= base / (6 + 10), (measured, base)


@pytest.mark.parametrize("fn, says", [
    ("raises", "reward function tests.e2e._grpo_rewards:raises raised ValueError: the grader "
               "is down"),
    ("too_few", "reward function tests.e2e._grpo_rewards:too_few returned 3 scores for 4 "
                "completions"),
    ("not_a_number", "reward function tests.e2e._grpo_rewards:not_a_number returned nan"),
])
def test_a_failing_reward_function_names_itself(fn, says):
    rewards = Rewards([f"tests.e2e._grpo_rewards:{fn}"], [1.0])
    with pytest.raises(TrainingError) as e:
        rewards.score(["p"] * 4, ["a", "b", "c", "d"])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


@pytest.mark.parametrize("extra, says", [
    ([], "trainer.objective=grpo needs a reward: rl.reward_functions=[module:function]"),
    (["rl.reward_functions=[nomodule]"], "rl.reward_functions: 'nomodule' is not "
                                         "module:function"),
    (["rl.reward_functions=[a:b]", "rl.reward_weights=[1,2]"], "rl.reward_weights has 2 "
                                                               "weights for 1 rewards"),
    (["rl.reward_functions=[a:b]", "rl.loss_type=sapo"], "rl.loss_type='sapo' is not one of: "
                                                         "dapo, grpo, dr_grpo, bnpo"),
    (["rl.reward_functions=[a:b]", "rl.num_generations=1"], "rl.num_generations=1 must be at "
                                                            "least 2"),
    (["rl.reward_functions=[a:b]", "trainer.tensor_parallel=2"], "tensor parallelism is not "
                                                                 "supported for it yet"),
    (["rl.reward_functions=[a:b]", "trainer.pipeline_parallel=2"], "pipeline"),
    (["rl.reward_models=[{hf}]"], "holds LlamaForCausalLM (a causal LM), not a reward model"),
    (["rl.reward_functions=[a:b]", "trainer.objective=rloo", "rl.num_generations=1"],
     "rl.num_generations=1 must be at least 2"),
])
def test_rl_config_is_checked(capsys, hf_llama, tmp_path, extra, says):
    line = cli_error(capsys, ["config", "show", "model.arch=hf", f"model.path={hf_llama}",
                              "data.format=prompts", f"data.source={tmp_path / 'p.jsonl'}",
                              *[e.format(hf=hf_llama) for e in extra]])
    assert says in line, line


# ---- PPO: TRL 1.x has no PPO trainer; its 0.x PPOTrainer (trl/trainer/ppo_trainer.py:
# compute_rewards, compute_advantages, loss; trl/core.py: masked_mean, masked_var, masked_whiten)
# transcribed here, and our pieces checked against it on the same tensors.
def _trl_ppo(scores, logprobs, ref_logprobs, values, vpreds, new_logprobs, mask, o):
    def masked_mean(x, m):
        return (x * m).sum() / m.sum()

    def masked_whiten(x, m):
        mean = masked_mean(x, m)
        var = masked_mean((x - mean) ** 2, m) * m.sum() / (m.sum() - 1)
        return (x - mean) * torch.rsqrt(var + 1e-8)

    rewards = []
    for score, lp, ref, m in zip(scores, logprobs, ref_logprobs, mask):
        reward = -o.kl_coef * (lp - ref)
        reward[m.nonzero()[-1]] += score
        rewards.append(reward)
    rewards, values = torch.stack(rewards) * mask, values * mask
    lastgaelam, reversed_ = 0, []
    gen_len = rewards.shape[-1]
    for t in reversed(range(gen_len)):
        nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
        delta = rewards[:, t] + o.gamma * nextvalues - values[:, t]
        lastgaelam = delta + o.gamma * o.lam * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1]).transpose(0, 1)
    returns = advantages + values
    advantages = masked_whiten(advantages, mask).detach()
    vpredclipped = torch.clamp(vpreds, values - o.cliprange_value, values + o.cliprange_value)
    vf_loss = 0.5 * masked_mean(torch.max((vpreds - returns) ** 2,
                                          (vpredclipped - returns) ** 2), mask)
    ratio = torch.exp(new_logprobs - logprobs)
    pg_loss = masked_mean(torch.max(-advantages * ratio, -advantages * torch.clamp(
        ratio, 1.0 - o.epsilon, 1.0 + o.epsilon)), mask)
    return pg_loss + o.vf_coef * vf_loss


def test_ppo_loss_and_gradient_equal_trls_formulas():
    """Rewards, GAE, whitening and the clipped policy + value loss, and the gradients with
    respect to the new log-probs and values (1e-6; float64)."""
    from paratrain.tasks.rl.ppo_loss import PPOOptions, gae, ppo_token_losses, token_rewards, whiten
    t = _tensors(1)
    g = torch.Generator().manual_seed(2)
    o = PPOOptions(kl_coef=0.1, gamma=0.99, lam=0.9, epsilon=0.2, cliprange_value=0.1,
                   vf_coef=0.3)
    scores = torch.randn(N, generator=g, dtype=torch.float64)
    values = torch.randn(N, C, generator=g, dtype=torch.float64) * t["mask"]
    vpreds = values + torch.randn(N, C, generator=g, dtype=torch.float64) * 0.3
    mask, old, new = t["mask"], t["old"], t["logps"]
    ours_in = [new.clone().requires_grad_(), vpreds.clone().requires_grad_()]
    rewards = token_rewards(scores, old, t["ref"], mask, o.kl_coef)
    advantages, returns = gae(rewards, values, mask, o.gamma, o.lam)
    n = mask.sum()
    mean = float((advantages * mask).sum() / n)
    var = float((((advantages - mean) ** 2) * mask).sum() / n * n / (n - 1))
    loss, _, _ = ppo_token_losses(ours_in[0], old, whiten(advantages, mask, mean, var),
                                  ours_in[1], values, returns, o)
    ours = (loss * mask).sum() / n
    ours.backward()
    theirs_in = [new.clone().requires_grad_(), vpreds.clone().requires_grad_()]
    theirs = _trl_ppo(scores, old, t["ref"], values, theirs_in[1], theirs_in[0], mask, o)
    theirs.backward()
    assert abs(float((ours - theirs).detach())) <= 1e-6, (float(ours.detach()),
                                                        float(theirs.detach()))
    for a, b in zip(ours_in, theirs_in):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-6)
        assert float(a.grad.abs().sum()) > 0
