"""Reward functions as TRL 1.16 calls them (tasks/rl/rewards.py): the records' other fields as
keyword lists aligned with the completions, `trainer_state.global_step`, `completion_ids`;
None for a completion a function does not score, skipped where rewards are summed; a failing
function names its file:line; a function missing from an importable module is said so."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.errors import ConfigError, TrainingError
from paratrain.tasks.rl.rewards import Rewards, load_reward
from tests.e2e import _grpo_rewards

M = "tests.e2e._grpo_rewards"


def test_a_reward_receives_the_records_fields_and_the_step_as_trl_passes_them():
    fields = [{"answer": "4", "level": 1}, {"answer": "9"}]
    Rewards([f"{M}:sees_everything"], [1.0]).score(
        ["2+2=", "3*3="], ["4", "6"], fields=fields, step=7, completion_ids=[[1], [2, 3]])
    seen = _grpo_rewards.SEEN
    assert seen["answer"] == ["4", "9"] and seen["level"] == [1, None]
    assert seen["trainer_state"].global_step == 7
    assert seen["completion_ids"] == [[1], [2, 3]]
    assert seen["prompts"] == ["2+2=", "3*3="] and seen["completions"] == ["4", "6"]


def test_a_math_reward_against_the_records_answer():
    scores = Rewards([f"{M}:exact_answer"], [1.0]).score(
        ["2+2=", "3*3="], ["4", "6"], fields=[{"answer": "4"}, {"answer": "9"}], step=0)
    assert scores[:, 0].tolist() == [1.0, 0.0]


def test_functions_without_kwargs_get_what_they_name_or_the_two_lists_by_position():
    scores = Rewards([f"{M}:digits", f"{M}:positional"], [1.0, 1.0]).score(
        ["p", "p"], ["12ab", "x"], fields=[{"answer": 1}, {"answer": 2}])
    assert scores.tolist() == [[0.5, 4.0], [0.0, 1.0]]


def test_none_is_a_completion_not_scored_and_the_sum_skips_it():
    """TRL: None -> NaN per function, the weighted nansum as the reward."""
    rewards = Rewards([f"{M}:scores_odd_only", f"{M}:digits"], [2.0, 1.0])
    per_fn = rewards.score(["p"] * 4, ["1", "a", "11", "b"])
    assert math.isnan(per_fn[0, 0]) and per_fn[1, 0] == 1.0
    assert rewards.total(per_fn).tolist() == [1.0, 2.0, 1.0, 2.0]


def test_a_completion_no_reward_scores_stops_the_run_in_one_line():
    with pytest.raises(TrainingError) as e:
        Rewards([f"{M}:scores_none"], [1.0]).score(["p"] * 2, ["a", "b"])
    assert str(e.value).startswith("every reward returned None for completion 1 of 2")


def test_a_failing_reward_names_its_file_and_line():
    with pytest.raises(TrainingError) as e:
        Rewards([f"{M}:raises"], [1.0]).score(["p"], ["a"])
    line = next(i for i, text in enumerate(open(_grpo_rewards.__file__), start=1)
                if "the grader is down" in text)
    assert f"(at {_grpo_rewards.__file__}:{line})" in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_function_missing_from_an_importable_module_is_said_so():
    with pytest.raises(ConfigError) as e:
        load_reward(f"{M}:no_such_reward")
    text = str(e.value)
    assert "has no 'no_such_reward'" in text and "digits" in text
    assert "PYTHONPATH" not in text
    with pytest.raises(ConfigError, match="put its module on PYTHONPATH"):
        load_reward("no_such_module_xyz:f")


def test_group_advantages_skip_nothing_when_every_completion_is_scored():
    """The sum over functions with a None in one of them is an ordinary number."""
    rewards = Rewards([f"{M}:scores_odd_only", f"{M}:digits"], [1.0, 1.0])
    assert not torch.isnan(rewards.total(rewards.score(["p"] * 2, ["1", "a"]))).any()
