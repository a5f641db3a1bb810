"""One contract over every registered task (config/registry.py), one row each in ROWS: 1 and 2
workers run the same steps, a run killed after a committed snapshot resumes bit-identical,
`paratrain plan` measures it (or gives its padding share and says in one line that it cannot
measure its memory yet), and its guide's example runs as printed. A registered task without a
row fails `test_every_registered_task_has_a_row`.

A row is a function of the session's shared inputs (`Inputs`, the session's `contract_inputs`)
giving the task's run: `Row`'s overrides on 2 CPU workers, 4 steps, a snapshot every 2; the
1-worker run is the same with the whole global batch in one process, as two micro-batches
(accumulation). The runs are the session's (tests/_runs.py): trained once, read by every test
here and by the task's own file (test_kto.py reads the KTO row's runs, test_dpo.py the DPO
row's, ...), which keeps only what is the task's own. A row's `layout` puts its 2-worker run
under FSDP or 2 workers accumulating, so that setting is checked at no extra run.
Adding a task: one line in ROWS."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

from paratrain.config import registry
from tests._runs import Run, trained_run
from tests._shared import held
from tests.conftest import QUIET_RECORDS, REPO, read_metrics, read_summary, run_cli
from tests.distributed._snapshot_helpers import assert_bit_identical, interrupted_copy
from tests.e2e._doc_blocks import doc_blocks
from tests.e2e._preference_data import labelled_rows, preference_rows, write_jsonl

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, EVERY = 4, 2  # a run's steps; a snapshot every EVERY (the killed run dies after the first)
# the final weights' tolerance: AdamW's first steps move a weight by about lr (3e-3 here) whatever
# its gradient's size, so the last bits of a tiny gradient, summed in another order on 2 workers,
# reach the weights a little above the losses' 1e-5 (measured: 1.2e-5 at most)
WEIGHTS_TOL = 5e-5
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "accuracy")


@dataclass(frozen=True)
class Inputs:
    """What the rows' runs read, made once per session (`folder`: for the rows' own files)."""
    preference_llama: Path
    preference_data: tuple[Path, Path]
    folder: Path
    corpus: Optional[Path] = None  # the native model's corpus and token cache (lm rows)
    cache: Optional[Path] = None
    t5: Optional[Path] = None  # a tiny encoder-decoder (the seq2seq row)


@dataclass(frozen=True)
class Row:
    """A task's contract: its run's overrides (from the session's inputs), the figures its 1-
    and 2-worker runs must share besides the loss, whether `paratrain plan` measures it, and
    the guide whose blocks this file runs (marked `run by: tests/e2e/test_task_contract.py`)."""
    settings: Optional[Callable[[Inputs], dict]] = None
    figures: tuple[str, ...] = ()
    plans: bool = True
    pads: bool = True  # where plan cannot measure it: whether it gives its padding share
    guide: Optional[str] = None
    # the 2-worker run's layout beside TWO (its strategy, its micro-batch), so that a setting
    # users change as a matter of course (FSDP, accumulation on 2 workers) is checked at no run
    layout: dict = field(default_factory=dict)


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


def _written(given: Inputs, name: str, rows: list[dict]) -> Path:
    """given.folder/name holding `rows`, written by the first row that reads it."""
    path = given.folder / name
    if not path.exists():
        write_jsonl(path, rows)
    return path


def _hf(model: Path, fmt: str, train: Path, val: Optional[Path] = None, **extra) -> dict:
    """A tiny local Hugging Face model on `train` (and `val`) as `fmt` records."""
    return {"model.arch": "hf", "model.path": str(model), "data.format": fmt,
            "data.source": str(train), **({"data.val_source": str(val)} if val else {}),
            "data.max_length": 64, "optim.lr": 3e-3, "optim.warmup_steps": 0, **extra}


def _lm(fmt: str) -> Callable[[Inputs], dict]:
    """The native tiny model on the corpus (`tiny_overrides`' model and data)."""
    def settings(given: Inputs) -> dict:
        return {"model.preset": "tiny", "data.source": str(given.corpus),
                "data.vocab_size": 384, "data.seq_length": 32,
                "data.cache_dir": str(given.cache), "data.format": fmt,
                "optim.warmup_steps": 2, "trainer.eval_samples": 37}
    return settings


def _pairs(given: Inputs, model: Path, **extra) -> dict:
    """Input -> output pairs: a prompt of random words -> the response with the keyword."""
    rows = lambda n, seed: [{"input": r["prompt"], "output": r["chosen"].strip()}  # noqa: E731
                            for r in preference_rows(n, seed)]
    return _hf(model, "pairs", _written(given, "pairs.jsonl", rows(96, 0)),
               _written(given, "pairs-val.jsonl", rows(21, 1)), **extra)


def _labelled(objective: str, **extra) -> Callable[[Inputs], dict]:
    """Texts labelled by the word they mention (an odd number held out: counted once)."""
    def settings(given: Inputs) -> dict:
        return _hf(given.preference_llama, "classify",
                   _written(given, "labelled.jsonl", labelled_rows(64, 0)),
                   _written(given, "labelled-val.jsonl", labelled_rows(9, 1)),
                   **{"trainer.objective": objective, "data.max_length": 32, **extra})
    return settings


def _embedding(given: Inputs) -> dict:
    """Anchor / positive / hard-negative records (the preference pairs' three parts)."""
    rows = lambda n, seed: [{"anchor": r["prompt"], "positive": r["chosen"],  # noqa: E731
                             "negative": r["rejected"]} for r in preference_rows(n, seed)]
    return _hf(given.preference_llama, "embedding", _written(given, "emb.jsonl", rows(96, 0)),
               _written(given, "emb-val.jsonl", rows(21, 1)), **{"embedding.pooling": "mean"})


def _prompts(objective: str, **extra) -> Callable[[Inputs], dict]:
    """64 prompts (one held out) and a dense rule reward, 2 completions each, seeded sampling.
    """
    def settings(given: Inputs) -> dict:
        prompts = _written(given, "prompts.jsonl",
                           [{"prompt": r["prompt"]} for r in preference_rows(64, 3)])
        return _hf(given.preference_llama, "prompts", prompts, **{
            "trainer.objective": objective, "rl.num_generations": 2, "rl.max_new_tokens": 8,
            "rl.reward_functions": "[tests.e2e._grpo_rewards:vowels]",
            "optim.schedule": "constant", **extra})
    return settings


FSDP = {"trainer.strategy": "fsdp"}
ACCUMULATING = {"trainer.batch_size": 2}  # 2 workers, 2 micro-steps each
SAMPLED = ("reward", "completions/mean_length")  # the same completions on 1 and 2 workers
ROWS: dict[tuple[str, str], Row] = {  # (data.format, trainer.objective) -> its contract
    ("packed", "lm"): Row(_lm("packed"), layout=ACCUMULATING),
    ("padded", "lm"): Row(_lm("padded"), layout=ACCUMULATING),
    ("pairs", "sft"): Row(lambda given: _pairs(given, given.preference_llama)),
    ("pairs", "seq2seq"): Row(lambda given: _pairs(given, given.t5), layout=FSDP, plans=False),
    ("chat", "sft"): Row(_chat),
    ("classify", "classify"): Row(_labelled("classify")),
    ("classify", "setfit"): Row(_labelled("setfit", **{"embedding.pair_iterations": 2}),
                                   plans=False, pads=False),
    ("preference", "dpo"): Row(_preference("dpo"), REWARDS),
    ("preference", "reward"): Row(_preference("reward"), REWARDS),
    ("preference", "kto"): Row(_preference("kto", **{"kto.undesirable_weight": 1.5}),
                               ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins")),
    ("preference", "orpo"): Row(_preference("orpo"), REWARDS + ("nll_loss", "log_odds_ratio"),
                                guide="docs/guides/preference.md"),
    ("preference", "simpo"): Row(_preference("simpo", **{"simpo.beta": 2.0}),
                                 REWARDS + ("nll_loss",)),
    ("embedding", "embedding"): Row(_embedding, plans=False, pads=False),
    ("prompts", "grpo"): Row(_prompts("grpo"), SAMPLED, layout=FSDP),
    ("prompts", "rloo"): Row(_prompts("rloo"), SAMPLED),
    ("prompts", "ppo"): Row(_prompts("ppo", **{"rl.num_iterations": 2}),
                            ("loss/policy", "loss/value"), layout=FSDP),
}
TWO = {"trainer.devices": "cpu:2", "trainer.batch_size": 4, "trainer.global_batch_size": 8,
       "trainer.max_steps": STEPS, "trainer.log_every": 1, "trainer.eval_every": 1000,
       "trainer.progress_bar": "false", "checkpoint.every_steps": EVERY,
       "checkpoint.record_samples": "true", "distributed.timeout_s": 60, **QUIET_RECORDS}
# the rows' processes import the RL rows' reward function (tests.e2e._grpo_rewards) from here
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
# the same global batch on one process, in two micro-batches: gradient accumulation, the setting
# users change first, is part of every row's "1 and 2 workers agree"
ONE = {**TWO, "trainer.devices": "cpu"}


@pytest.fixture
def inputs(contract_inputs) -> Inputs:
    return contract_inputs  # the session's (tests/e2e/conftest.py): other files read its runs


def settings_of(key: tuple[str, str], given: Inputs) -> dict:
    """The row's overrides; the files it writes into the session's folder are written whole
    before another xdist worker may look for them (one lock over the rows' writers)."""
    with held(given.folder / "rows.lock"):
        return ROWS[key].settings(given)


def runs_of(tmp_path_factory, key: tuple[str, str], given: Inputs) -> tuple[Run, Run]:
    """(the row's 1-worker run, its 2-worker run in the row's layout): the session's."""
    own = settings_of(key, given)
    return (trained_run(tmp_path_factory, {**ONE, **own}, timeout=400, env=ENV),
            trained_run(tmp_path_factory, {**TWO, **own, **ROWS[key].layout}, timeout=400,
                        env=ENV))


def assert_same_weights(a: Path, b: Path) -> None:
    """The two model/ folders hold the same tensors, within WEIGHTS_TOL; a tensor saved in one
    only must be a tied copy of one both hold (FSDP's save keeps T5's tied embeddings under
    each of their names, transformers' own save once)."""
    import torch
    from safetensors.torch import load_file
    w_a, w_b = (load_file(str(folder / "model.safetensors")) for folder in (a, b))
    both = w_a.keys() & w_b.keys()
    for w, only in ((w_a, w_a.keys() - both), (w_b, w_b.keys() - both)):
        for name in only:
            assert any(torch.equal(w[name], w[k]) for k in both), f"{name}: in one run only"
    assert max((w_a[k] - w_b[k]).abs().max().item() for k in both) <= WEIGHTS_TOL


def test_every_registered_task_has_a_row():
    registered = {(s.name, s.objective) for s in registry.specs()}
    assert registered - set(ROWS) == set(), "registered tasks without a row in ROWS"
    assert set(ROWS) - registered == set(), "rows of tasks that are not registered"


@pytest.mark.parametrize("key", list(ROWS), ids="-".join)
def test_one_and_two_workers_agree(tmp_path_factory, inputs, key):
    """The loss unit summed over ranks and micro-steps: the split does not matter, for the
    loss, the task's own figures, the final weights and the validation set (counted once)."""
    one, two = runs_of(tmp_path_factory, key, inputs)
    rows, other = read_metrics(one.dir), read_metrics(two.dir)
    assert [r["step"] for r in rows] == [r["step"] for r in other] == list(range(1, STEPS + 1))
    for x, y in zip(rows, other):
        for name in ("loss",) + ROWS[key].figures:
            assert abs(x[name] - y[name]) <= 1e-5, (x["step"], name, x[name], y[name])
    assert_same_weights(one.dir / "model", two.dir / "model")
    s1, s2 = read_summary(one.dir), read_summary(two.dir)
    val = sorted(k for k in s1 if k.startswith("val_") and isinstance(s1[k], (int, float)))
    assert "val_loss" in val and [k for k in s2 if k.startswith("val_")] and \
        all(s1[k] == pytest.approx(s2[k], rel=1e-5, abs=1e-5) for k in val), (s1, s2)


@pytest.mark.parametrize("key", list(ROWS), ids="-".join)
def test_a_killed_run_resumes_bit_identical(tmp_path_factory, tmp_path, inputs, key):
    """Died after the step-EVERY snapshot: the same command resumes and ends bit-identical
    (losses, samples per step, final weights)."""
    _, two = runs_of(tmp_path_factory, key, inputs)
    died = interrupted_copy(two.dir, tmp_path / "died", keep_until=EVERY)
    r = run_cli(["train"] + two.overrides + [f"run.dir={died}"], cwd=tmp_path, timeout=400,
                env=two.env)
    assert r.returncode == 0 and f"resumed from step {EVERY}" in r.stderr, r.stderr[-3000:]
    assert_bit_identical(died, two.dir)
    for name in ROWS[key].figures:  # the task's own figures too (KTO's KL estimate, rewards)
        assert [m[name] for m in read_metrics(died)] == [m[name] for m in read_metrics(two.dir)]


@pytest.mark.parametrize("key", list(ROWS), ids="-".join)
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
        assert code == 0 and "paratrain plan cannot measure" in out, out + err[-3000:]
        assert ("padding: about" in out) == ROWS[key].pads, out


def _guide_blocks(page: str) -> list[list[str]]:
    """The commands of `page`'s blocks this file runs, as printed."""
    blocks = [b for b in doc_blocks() if b.page == page and b.marker == "run by"
              and b.reason.startswith("tests/e2e/test_task_contract.py")]
    assert blocks, f"{page} has no block run by tests/e2e/test_task_contract.py"
    return [cmd for b in blocks for cmd in b.commands()]


@pytest.mark.parametrize("key", [k for k in ROWS if ROWS[k].guide], ids="-".join)
def test_its_guide_example_runs_as_printed(tmp_path, inputs, key):
    """In a folder holding a tiny local my-model/ and 64 pairs in prefs.jsonl."""
    shutil.copytree(inputs.preference_llama, tmp_path / "my-model")
    write_jsonl(tmp_path / "prefs.jsonl", preference_rows(64, 5))
    for args in _guide_blocks(ROWS[key].guide):
        assert args[0] == "paratrain", args
        r = run_cli(args[1:], cwd=tmp_path, timeout=400)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr[-3000:])
    assert [read_summary(run)["steps"] for run in (tmp_path / "runs").iterdir()] == [4]
