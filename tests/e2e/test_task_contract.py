"""One contract over every registered task (config/registry.py), one row each in ROWS: 1 and 2
workers run the same steps, a run killed after a committed snapshot resumes bit-identical,
`paratrain plan` measures it (or gives its padding share and says in one line that it cannot
measure its memory yet), and its guide's example
runs as printed. A registered task without a row fails `test_every_registered_task_has_a_row`.

A row is a function of the session's shared inputs (`Inputs`) giving the task's run: `Row`'s
overrides on 2 CPU workers, 4 steps, a snapshot every 2; the 1-worker run is the same with the
whole global batch in one process, as two micro-batches (accumulation). The runs are the session's (tests/_runs.py): trained once,
read by every test here and by the task's own file (test_kto.py reads the KTO row's runs). A row
not moved here yet names the test that checks its workers (`elsewhere`): that test must exist.
Adding a task: one line in ROWS."""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

from paratrain.config import registry
from tests._runs import Run, trained_run
from tests.conftest import REPO, read_metrics, read_summary, run_cli
from tests.distributed._snapshot_helpers import assert_bit_identical, interrupted_copy
from tests.e2e._doc_blocks import doc_blocks
from tests.e2e._preference_data import preference_rows, write_jsonl

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, EVERY = 4, 2  # a run's steps; a snapshot every EVERY (the killed run dies after the first)
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "accuracy")


@dataclass(frozen=True)
class Inputs:
    """What the rows' runs read, made once per session (`folder`: for the rows' own files)."""
    preference_llama: Path
    preference_data: tuple[Path, Path]
    folder: Path


@dataclass(frozen=True)
class Row:
    """A task's contract: its run's overrides (from the session's inputs), the figures its 1-
    and 2-worker runs must share besides the loss, whether `paratrain plan` measures it, and
    the guide whose blocks this file runs (marked `run by: tests/e2e/test_task_contract.py`)."""
    settings: Optional[Callable[[Inputs], dict]] = None
    figures: tuple[str, ...] = ()
    plans: bool = True
    guide: Optional[str] = None
    elsewhere: Optional[str] = None  # "tests/...py::test_name": a row not moved here yet


def _preference(objective: str, **extra) -> Callable[[Inputs], dict]:
    def settings(given: Inputs) -> dict:
        train, val = given.preference_data
        return {"model.arch": "hf", "model.path": str(given.preference_llama),
                "data.source": str(train), "data.val_source": str(val),
                "data.format": "preference", "trainer.objective": objective,
                "data.max_length": 64, "optim.lr": 3e-3, "optim.warmup_steps": 0, **extra}
    return settings


def _chat(given: Inputs) -> dict:
    """The preference pairs' prompts and chosen responses as user / assistant turns, rendered
    with a template of the test's own (the tiny model has none)."""
    chat, template = given.folder / "chat.jsonl", given.folder / "template.jinja"
    if not chat.exists():
        write_jsonl(chat, [{"messages": [{"role": "user", "content": r["prompt"]},
                                         {"role": "assistant", "content": r["chosen"]}]}
                           for r in preference_rows(96, 7)])
        template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    return {"model.arch": "hf", "model.path": str(given.preference_llama),
            "data.source": str(chat), "data.format": "chat", "data.chat_template": str(template),
            "data.max_length": 64, "data.val_fraction": 0.1, "optim.lr": 3e-3}


def _elsewhere(path: str, test: str) -> Row:
    return Row(elsewhere=f"{path}::{test}")


ROWS: dict[tuple[str, str], Row] = {  # (data.format, trainer.objective) -> its contract
    ("packed", "lm"): _elsewhere("tests/distributed/test_ddp.py",
                                 "test_one_and_two_workers_give_the_same_run"),
    ("padded", "lm"): _elsewhere("tests/distributed/test_ddp.py",
                                 "test_one_and_two_workers_give_the_same_run"),
    ("pairs", "sft"): _elsewhere("tests/e2e/test_finetune.py",
                                 "test_one_and_two_workers_give_the_same_losses"),
    ("pairs", "seq2seq"): _elsewhere("tests/e2e/test_seq2seq.py",
                                     "test_one_two_workers_and_fsdp_give_the_same_losses"),
    ("chat", "sft"): Row(_chat, plans=False),
    ("classify", "classify"): _elsewhere("tests/e2e/test_classify.py",
                                         "test_one_and_two_workers_give_the_same_run"),
    ("classify", "setfit"): _elsewhere(
        "tests/e2e/test_setfit.py",
        "test_setfit_on_one_and_two_workers_and_with_the_setfit_package"),
    ("preference", "dpo"): _elsewhere(
        "tests/e2e/test_dpo.py", "test_step_one_is_log_2_and_one_two_workers_and_fsdp_agree"),
    ("preference", "reward"): Row(_preference("reward"), REWARDS, plans=False),
    ("preference", "kto"): Row(_preference("kto", **{"kto.undesirable_weight": 1.5}),
                               ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins")),
    ("preference", "orpo"): Row(_preference("orpo"), REWARDS + ("nll_loss", "log_odds_ratio"),
                                guide="docs/guides/preference.md"),
    ("preference", "simpo"): Row(_preference("simpo", **{"simpo.beta": 2.0}),
                                 REWARDS + ("nll_loss",)),
    ("embedding", "embedding"): _elsewhere(
        "tests/e2e/test_embedding.py", "test_the_guide_runs_and_one_and_two_workers_agree"),
    ("prompts", "grpo"): _elsewhere(
        "tests/e2e/test_grpo.py", "test_one_worker_and_fsdp_sample_and_learn_the_same"),
    ("prompts", "rloo"): _elsewhere(
        "tests/e2e/test_grpo.py", "test_accumulation_on_one_process_is_two_ddp_workers"),
    ("prompts", "ppo"): _elsewhere(
        "tests/e2e/test_grpo.py", "test_ppo_is_the_same_on_one_process_and_two_fsdp_workers"),
}
HERE = [key for key, row in ROWS.items() if row.elsewhere is None]
TWO = {"trainer.devices": "cpu:2", "trainer.batch_size": 4, "trainer.global_batch_size": 8,
       "trainer.max_steps": STEPS, "trainer.log_every": 1, "trainer.eval_every": 1000,
       "trainer.progress_bar": "false", "checkpoint.every_steps": EVERY,
       "checkpoint.record_samples": "true", "distributed.timeout_s": 60}
# the same global batch on one process, in two micro-batches: gradient accumulation, the setting
# users change first, is part of every row's "1 and 2 workers agree"
ONE = {**TWO, "trainer.devices": "cpu"}


@pytest.fixture(scope="module")
def inputs(preference_llama, preference_data, tmp_path_factory) -> Inputs:
    return Inputs(preference_llama, preference_data, tmp_path_factory.mktemp("contract"))


def settings_of(key: tuple[str, str], given: Inputs) -> dict:
    return ROWS[key].settings(given)


def runs_of(tmp_path_factory, key: tuple[str, str], given: Inputs) -> tuple[Run, Run]:
    """(the row's 1-worker run, its 2-worker run): the session's."""
    own = settings_of(key, given)
    return (trained_run(tmp_path_factory, {**ONE, **own}, timeout=400),
            trained_run(tmp_path_factory, {**TWO, **own}, timeout=400))


def test_every_registered_task_has_a_row():
    registered = {(s.name, s.objective) for s in registry.specs()}
    assert registered - set(ROWS) == set(), "registered tasks without a row in ROWS"
    assert set(ROWS) - registered == set(), "rows of tasks that are not registered"


@pytest.mark.parametrize("key", [k for k in ROWS if ROWS[k].elsewhere], ids="-".join)
def test_a_row_not_moved_here_names_a_test_that_exists(key):
    path, _, name = ROWS[key].elsewhere.partition("::")
    tree = ast.parse((REPO / path).read_text())
    assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, \
        ROWS[key].elsewhere


@pytest.mark.parametrize("key", HERE, ids="-".join)
def test_one_and_two_workers_agree(tmp_path_factory, inputs, key):
    """The loss unit summed over ranks and micro-steps: the split does not matter, for the
    loss, the task's own figures, the final weights and the validation set (counted once)."""
    from tests.conftest import assert_runs_agree
    one, two = runs_of(tmp_path_factory, key, inputs)
    rows = assert_runs_agree(one.dir, two.dir, ("loss",) + ROWS[key].figures)
    assert len(rows) == STEPS
    s1, s2 = read_summary(one.dir), read_summary(two.dir)
    val = sorted(k for k in s1 if k.startswith("val_") and isinstance(s1[k], (int, float)))
    assert "val_loss" in val and [k for k in s2 if k.startswith("val_")] and \
        all(s1[k] == pytest.approx(s2[k], rel=1e-5, abs=1e-5) for k in val), (s1, s2)


@pytest.mark.parametrize("key", HERE, ids="-".join)
def test_a_killed_run_resumes_bit_identical(tmp_path_factory, tmp_path, inputs, key):
    """Died after the step-EVERY snapshot: the same command resumes and ends bit-identical
    (losses, samples per step, final weights)."""
    _, two = runs_of(tmp_path_factory, key, inputs)
    died = interrupted_copy(two.dir, tmp_path / "died", keep_until=EVERY)
    r = run_cli(["train"] + two.overrides + [f"run.dir={died}"], cwd=tmp_path, timeout=400)
    assert r.returncode == 0 and f"resumed from step {EVERY}" in r.stderr, r.stderr[-3000:]
    assert_bit_identical(died, two.dir)
    for name in ROWS[key].figures:  # the task's own figures too (KTO's KL estimate, rewards)
        assert [m[name] for m in read_metrics(died)] == [m[name] for m in read_metrics(two.dir)]


@pytest.mark.parametrize("key", HERE, ids="-".join)
def test_plan_measures_it_or_says_it_cannot(capsys, tmp_path, inputs, key):
    from paratrain import cli
    over = {**TWO, **settings_of(key, inputs), "run.dir": tmp_path / "run"}
    capsys.readouterr()
    code = cli.main(["plan"] + [f"{k}={v}" for k, v in over.items()])
    out, err = capsys.readouterr()
    if ROWS[key].plans:
        assert code == 0 and "trainer.strategy=auto picks" in out + err, err[-3000:]
        assert any(line.split()[:1] == ["ddp"] for line in out.splitlines()), out
    else:  # its padding share, and one line saying the memory is not measured yet
        assert code == 0 and "padding: about" in out and \
            "paratrain plan cannot measure" in out, out + err[-3000:]


def _guide_blocks(page: str) -> list[list[str]]:
    """The commands of `page`'s blocks this file runs, as printed."""
    blocks = [b for b in doc_blocks() if b.page == page and b.marker == "run by"
              and b.reason.startswith("tests/e2e/test_task_contract.py")]
    assert blocks, f"{page} has no block run by tests/e2e/test_task_contract.py"
    return [cmd for b in blocks for cmd in b.commands()]


@pytest.mark.parametrize("key", [k for k in HERE if ROWS[k].guide], ids="-".join)
def test_its_guide_example_runs_as_printed(tmp_path, inputs, key):
    """In a folder holding a tiny local my-model/ and 64 pairs in prefs.jsonl."""
    shutil.copytree(inputs.preference_llama, tmp_path / "my-model")
    write_jsonl(tmp_path / "prefs.jsonl", preference_rows(64, 5))
    for args in _guide_blocks(ROWS[key].guide):
        assert args[0] == "paratrain", args
        r = run_cli(args[1:], cwd=tmp_path, timeout=400)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr[-3000:])
    assert [read_summary(run)["steps"] for run in (tmp_path / "runs").iterdir()] == [4]
