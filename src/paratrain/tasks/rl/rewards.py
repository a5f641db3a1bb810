"""The rewards of online RL (grpo.py): functions `f(prompts, completions, **kwargs) ->
list[float]`, named `module:function` in rl.reward_functions (the Python API passes the
functions, which it names so), and reward models (rl.reward_models: reward_models.py), summed
with rl.reward_weights (the advantages they give: advantages.py).

A function is called as TRL 1.16 GRPOTrainer calls it: `prompts`, `completions`,
`completion_ids` and every other field of the prompts' records (a reference answer, test
cases) as keyword lists aligned with the completions, and `trainer_state` (its `global_step`:
the optimizer steps done). A function without **kwargs receives the keywords it names (TRL
would fail on the others); one whose first two parameters are not named prompts / completions
receives those two by position. A score may be None, a completion the function does not score
(TRL's convention): the weighted sum skips it; a completion no reward scores stops the run
(TRL warns and gives it advantage 0).

A reward function that raises (its file:line named), returns another number of scores than
completions, or a score that is not a finite number stops the run with one line naming it:
nothing is trained on it.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ...errors import ConfigError, TrainingError
from ...formatting import first_line
from .reward_models import RewardModelScorer, reward_model_key

RewardFn = Callable[..., Sequence[Optional[float]]]


@dataclass(frozen=True)
class RewardState:
    """What a reward function receives as `trainer_state` (TRL passes transformers'
    TrainerState): `global_step`, the optimizer steps done before this one."""
    global_step: int


def reward_name(fn: Callable) -> str:
    """`module:function` of a function defined at a module's top level (what the config holds);
    one ConfigError line for a lambda or a function inside another."""
    name = f"{fn.__module__}:{fn.__qualname__}"
    if "<" in fn.__qualname__ or "." in fn.__qualname__:
        raise ConfigError(f"reward function {name} cannot be found by name in the worker "
                          "processes; define it at the top level of a module (not a lambda or "
                          "a function inside another function)")
    return name


def load_reward(name: str) -> RewardFn:
    """The function of `module:function`, or one ConfigError line saying why not. A module
    next to the command is found as `python -m` finds it (the console script would not)."""
    module, _, attr = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"rl.reward_functions: cannot import {name} ({type(e).__name__}: "
                          f"{first_line(e)}); put its module on PYTHONPATH or next to the "
                          "command") from None
    fn = getattr(found, attr, None)
    if fn is None:
        where = getattr(found, "__file__", None) or module
        known = sorted(k for k, v in vars(found).items()
                       if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == found.__name__)
        raise ConfigError(f"rl.reward_functions: module {module} ({where}) has no {attr!r}; "
                          f"its functions: {', '.join(known) or 'none'}")
    if not callable(fn):
        raise ConfigError(f"rl.reward_functions: {name} is not a function")
    return fn


def short_name(name: str) -> str:
    """The function's own name: how TRL's metrics name it (rewards/<name>/mean)."""
    return name.rpartition(":")[2]


@dataclass
class Rewards:
    """The run's reward functions, then its reward models (folders, reward_models.py), and one
    weight for each, in that order."""
    names: list[str]
    weights: list[float]
    models: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.scorers = [RewardModelScorer(m) for m in self.models]

    @classmethod
    def of(cls, rl: Any) -> "Rewards":
        names, models = list(rl.reward_functions), list(rl.reward_models)
        for name in names:
            load_reward(name)  # before any worker starts: a typo costs a second
        n = len(names) + len(models)
        weights = list(rl.reward_weights) if rl.reward_weights is not None else [1.0] * n
        return cls(names, [float(w) for w in weights], models)

    @property
    def labels(self) -> list[str]:
        """What the figures call each reward (rewards/<label>/mean): a function's name, a
        reward model's folder (a run's, for its model/)."""
        return [short_name(n) for n in self.names] + [model_label(m) for m in self.models]

    def score(self, prompts: list, completions: list[str], frozen: Any = None,
              device: Any = "cpu", amp: Any = None, fields: Optional[list] = None,
              step: int = 0, completion_ids: Optional[list] = None) -> torch.Tensor:
        """(N, F) each reward's score of each completion, NaN where a function returned None
        (prompts, `fields` (the records' other fields, a dict each) and `completion_ids`: one
        per completion); the reward models are the run's frozen models `reward_model_<i>`."""
        extra = _columns(fields or [{} for _ in completions])
        extra.update({"completion_ids": completion_ids if completion_ids is not None
                      else [[] for _ in completions], "trainer_state": RewardState(step)})
        columns = [self._call(name, prompts, completions, extra) for name in self.names]
        for i, scorer in enumerate(self.scorers):
            columns.append(scorer.score(frozen[reward_model_key(i)], prompts, completions,
                                        device, amp or nullcontext()))
        out = torch.tensor(columns, dtype=torch.float64).T.contiguous()  # (N, F)
        unscored = torch.isnan(out).all(dim=1)  # (N,)
        if bool(unscored.any()):
            row = int(unscored.nonzero()[0, 0])
            raise TrainingError(f"every reward returned None for completion {row + 1} of "
                                f"{len(completions)} ({', '.join(self.names)}); at least one "
                                "must score each completion")
        return out

    def _call(self, name: str, prompts: list, completions: list[str], extra: dict
              ) -> list[float]:
        fn = load_reward(name)
        args, kwargs = _arguments(fn, prompts, completions, extra)
        try:
            scores = list(fn(*args, **kwargs))
        except Exception as e:
            raise TrainingError(f"reward function {name} raised {type(e).__name__}: "
                                f"{first_line(e)} (at {_where(e)})") from None
        if len(scores) != len(completions):
            raise TrainingError(f"reward function {name} returned {len(scores)} scores for "
                                f"{len(completions)} completions; return one float each")
        try:
            values = [math.nan if s is None else float(s) for s in scores]
        except (TypeError, ValueError):
            bad = next(s for s in scores if s is not None and not _is_number(s))
            raise TrainingError(f"reward function {name} returned {bad!r}, not a number; return "
                                "one float (or None) per completion") from None
        bad_values = [v for v, s in zip(values, scores) if s is not None and not math.isfinite(v)]
        if bad_values:
            raise TrainingError(f"reward function {name} returned {bad_values[0]} for a "
                                "completion; rewards must be finite numbers (nothing was "
                                "trained on it)")
        return values

    def total(self, per_function: torch.Tensor) -> torch.Tensor:
        """(N, F) -> (N,) the weighted sum of the scores given (None's NaN skipped: TRL's
        nansum)."""
        return per_function.nan_to_num(0.0) @ torch.tensor(self.weights,
                                                            dtype=per_function.dtype)


def _columns(fields: list) -> dict:
    """The records' other fields as keyword lists aligned with the completions (TRL's
    reward_kwargs); a field a record lacks is None there."""
    keys = list(dict.fromkeys(k for f in fields for k in f))
    return {k: [f.get(k) for f in fields] for k in keys}


def _arguments(fn: Callable, prompts: list, completions: list, extra: dict
               ) -> tuple[tuple, dict]:
    """(args, kwargs) to call `fn` with (module docstring): all of it for **kwargs, else the
    keywords it names."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: the two lists by position
        return (prompts, completions), {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return (), {"prompts": prompts, "completions": completions, **extra}
    named = {k: v for k, v in extra.items() if k in params}
    if "prompts" in params and "completions" in params:
        return (), {"prompts": prompts, "completions": completions, **named}
    return (prompts, completions), named


def _where(e: BaseException) -> str:
    """file:line of the innermost frame the exception passed (the reward function's line)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown place"


def model_label(folder: str) -> str:
    path = Path(folder)
    return path.parent.name if path.name == "model" else path.name


def _is_number(x: Any) -> bool:
    try:
        float(x)
        return True
    except (TypeError, ValueError):
        return False
