"""Rule rewards for the GRPO tests, importable by name from the worker processes
(`tests.e2e._grpo_rewards:letter_e`)."""

from __future__ import annotations


def digits(prompts: list, completions: list[str]) -> list[float]:
    """The share of a completion's characters that are digits (about a third for the tiny
    random model): a dense rule reward that rises within a few dozen steps."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


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
