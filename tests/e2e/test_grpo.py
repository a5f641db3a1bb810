"""GRPO end to end and offline (data.format=prompts, trainer.objective=grpo): a tiny random Llama
built here, 64 prompt records and a rule reward (the share of digits in a completion,
tests/e2e/_grpo_rewards.py). One real 2-worker run of 30 steps raises the mean reward
measurably; one process and 2 FSDP workers give the same first 5 steps (the same completions,
as their rewards show to 1e-12, and losses within 1e-5); a reward function that breaks mid-run
stops the run in one line with its snapshots kept, and the same command resumes from them to
the same final weights, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    REPO,
    cli_env,
    cli_refusal,
    cli_run,
    make_hf_llama,
    read_metrics,
    run_cli,
)

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(600)]

REWARD = "tests.e2e._grpo_rewards:digits"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """(the model folder, the prompts file)."""
    tmp = tmp_path_factory.mktemp("grpo")
    texts = [f"def function_{i}(x):\n    return x + {i}\n" for i in range(200)]
    model = make_hf_llama(tmp / "llama", texts)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def function_{i}("}) + "\n"
                               for i in range(64)))
    return model, prompts


def grpo_args(setup: tuple[Path, Path], run_dir: Path, **extra) -> list[str]:
    model, prompts = setup
    base = {"model.arch": "hf", "model.path": model, "data.format": "prompts",
            "data.source": prompts, "data.cache_dir": run_dir.parent / "cache",
            "rl.reward_functions": f"[{REWARD}]", "rl.num_generations": 4,
            "rl.max_new_tokens": 16, "trainer.global_batch_size": 4, "trainer.log_every": 1,
            "optim.lr": 3e-3, "optim.warmup_steps": 0, "optim.schedule": "constant",
            "trainer.progress_bar": False, "log.report": False, "log.tensorboard": False,
            "run.dir": run_dir, **extra}
    return ["train"] + [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory, setup) -> list[dict]:
    """30 steps on 2 CPU workers (2 prompts each, 4 completions per prompt)."""
    tmp = tmp_path_factory.mktemp("grpo-two")
    r = run_cli(grpo_args(setup, tmp / "run", **{"trainer.devices": "cpu:2",
                                                 "trainer.batch_size": 2,
                                                 "trainer.max_steps": 30}), cwd=tmp, timeout=400,
                env=cli_env({"PYTHONPATH": str(REPO)}))  # the reward's module
    assert r.returncode == 0, r.stderr[-3000:]
    return read_metrics(tmp / "run")


@pytest.mark.slow
def test_grpo_raises_the_reward(two_workers):
    """The last 5 steps' mean reward is above the first 5 steps' by a margin (measured: 0.38 ->
    0.53 in one process; the random model writes about a third digits), with TRL's figures and
    the time split in every line."""
    rewards = [m["reward"] for m in two_workers]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.07, (first, last, rewards)
    for key in ("reward_std", "rewards/digits/mean", "rewards/digits/std", "entropy",
                "clip_ratio/region_mean", "completions/mean_length", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio", "frac_reward_zero_std",
                "time/generation_s", "time/scoring_s", "time/learning_s", "lr"):
        assert key in two_workers[-1], key
    assert two_workers[-1]["completions/max_length"] <= 16


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory, setup) -> Path:
    """The first 5 steps in one process."""
    tmp = tmp_path_factory.mktemp("grpo-one")
    r = run_cli(grpo_args(setup, tmp / "run", **{"trainer.devices": "cpu",
                                                 "trainer.batch_size": 4,
                                                 "trainer.max_steps": 5}), cwd=tmp, timeout=300,
                env=cli_env({"PYTHONPATH": str(REPO)}))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run"


@pytest.mark.slow
def test_one_worker_and_fsdp_sample_and_learn_the_same(tmp_path, setup, one_worker,
                                                       two_workers):
    """One process, 2 DDP workers and 2 FSDP workers, the first 5 steps: the same completions
    (their rewards equal to 1e-12, their lengths exactly) and the same losses (1e-5)."""
    r = run_cli(grpo_args(setup, tmp_path / "fsdp", **{
        "trainer.devices": "cpu:2", "trainer.strategy": "fsdp", "trainer.batch_size": 2,
        "trainer.max_steps": 5}), cwd=tmp_path, timeout=300,
        env=cli_env({"PYTHONPATH": str(REPO)}))
    assert r.returncode == 0, r.stderr[-3000:]
    one = read_metrics(one_worker)
    for other in (two_workers[:5], read_metrics(tmp_path / "fsdp")):
        assert len(other) == len(one) == 5
        for a, b in zip(one, other):
            assert abs(a["reward"] - b["reward"]) <= 1e-12, (a, b)
            assert a["completions/mean_length"] == b["completions/mean_length"]
            assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["loss"], b["loss"])


@pytest.mark.slow
def test_a_reward_function_that_breaks_stops_the_run_in_one_line(capsys, tmp_path, setup,
                                                                 one_worker):
    """It names the function and the error, exits 2, and the snapshots of the steps before it
    stay committed: the same command resumes from the last one and ends with the weights of the
    run that never stopped, bit for bit."""
    from safetensors.torch import load_file

    from tests.e2e import _grpo_rewards
    _grpo_rewards.CALLS["fails_third"] = 0
    args = grpo_args(setup, tmp_path / "run", **{
        "trainer.devices": "cpu", "trainer.batch_size": 4, "trainer.max_steps": 5,
        "rl.reward_functions": "[tests.e2e._grpo_rewards:fails_third]",
        "checkpoint.every_steps": 1})
    line, err = cli_refusal(capsys, args)
    assert line == ("paratrain: error: reward function tests.e2e._grpo_rewards:fails_third "
                    "raised RuntimeError: the grader is down"), err
    snapshots = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert snapshots == ["step-0000001", "step-0000002"], snapshots
    assert not (tmp_path / "run" / "model").exists()
    _grpo_rewards.CALLS["fails_third"] = -100  # the grader is back
    r = cli_run(capsys, args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step-0000002" in r.stderr, r.stderr
    resumed = load_file(tmp_path / "run" / "model" / "model.safetensors")
    straight = load_file(one_worker / "model" / "model.safetensors")
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
