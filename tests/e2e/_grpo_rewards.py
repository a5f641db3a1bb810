"""Rule rewards for the GRPO tests, importable by name from the worker processes
(`tests.e2e._grpo_rewards:letter_e`)."""

from __future__ import annotations


def digits(prompts: list, completions: list[str]) -> list[float]:
    """The share of a completion's characters that are digits (about a third for the tiny
    random model): a dense rule reward that rises within a few dozen steps."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def vowels(prompts: list, completions: list[str]) -> list[float]:
    """The share of a completion's characters that are vowels: a dense rule reward for a model
    whose tokenizer learnt words (the task contract's RL rows)."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def raises(prompts: list, completions: list[str]) -> list[float]:
    raise ValueError("the grader is down")


def too_few(prompts: list, completions: list[str]) -> list[float]:
    return [0.0] * (len(completions) - 1)


def not_a_number(prompts: list, completions: list[str]) -> list[float]:
    return [float("nan")] * len(completions)


CALLS = {"fails_third": 0}


def fails_third(prompts: list, completions: list[str]) -> list[float]:
    """Scores two steps (one call each), then raises: a reward that breaks mid-run."""
    CALLS["fails_third"] += 1
    if CALLS["fails_third"] >= 3:
        raise RuntimeError("the grader is down")
    return digits(prompts, completions)


def exact_answer(completions: list[str], answer: list[str], trainer_state, **kwargs
                 ) -> list[float]:
    """TRL's convention: the records' `answer` field, aligned with the completions, and the
    trainer's state; 1.0 when the completion holds the answer."""
    assert trainer_state.global_step >= -1
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]


def sees_everything(prompts, completions, **kwargs) -> list[float]:
    """Records what TRL passes (for the unit test)."""
    SEEN.clear()
    SEEN.update(kwargs, prompts=prompts, completions=completions)
    return [0.0] * len(completions)


SEEN: dict = {}


def scores_odd_only(prompts, completions, **kwargs) -> list:
    """None for every other completion: a function that does not score them."""
    return [1.0 if i % 2 else None for i in range(len(completions))]


def scores_none(prompts, completions, **kwargs) -> list:
    return [None] * len(completions)


def positional(p, c) -> list[float]:
    """A function whose parameters are not named prompts / completions."""
    return [float(len(x)) for x in c]
