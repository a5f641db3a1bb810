"""The guides as a newcomer meets them: every input a guide's commands read is shown on the page
(a sample row, outside any HTML comment) and made by a block the docs test runs as printed; the
commands do not warn about themselves (a warmup as long as the run) or set what another key
silently overrides (trainer.epochs under max_steps' default); the setfit extra installs what
loading a SetFit result needs and Get started lists every extra; LoRA on 2 GPUs has a page."""

from __future__ import annotations

import json
import re
import sys

import pytest

from paratrain.config import TrainConfig
from paratrain.launch.environment import parse_devices
from paratrain.runtime.optim import schedule_warnings
from tests.conftest import REPO
from tests.e2e._doc_blocks import doc_blocks

_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


def _visible(page: str) -> str:
    """The page's text as the site shows it (HTML comments are not shown)."""
    return _COMMENT.sub("", (REPO / page).read_text())


def _run_here(page: str) -> str:
    """The commands of the page's blocks that tests/e2e/test_doc_blocks.py runs as printed."""
    return "\n".join(b.code for b in doc_blocks() if b.page == page and b.marker is None)


@pytest.mark.parametrize("page, inputs", [
    ("docs/guides/online-rl.md", {"my-model": "checkpoint export runs/tiny my-model",
                                  "prompts.jsonl": "open('prompts.jsonl', 'w')"}),
    ("docs/guides/embeddings.md", {"pairs.jsonl": "('pairs.jsonl', rows[:120])",
                                   "pairs-val.jsonl": "('pairs-val.jsonl', rows[120:])",
                                   "reviews.jsonl": "open('reviews.jsonl', 'w')"}),
])
def test_each_guide_shows_and_makes_its_inputs(page, inputs):
    text, made = _visible(page), _run_here(page)
    for name, maker in inputs.items():
        assert name in text, f"{page} does not show {name}"
        assert maker in made, f"{page}: no block the docs test runs makes {name}"
    samples = re.findall(r"```text\n(.*?)```", text, re.DOTALL)
    rows = [json.loads(x) for s in samples for x in s.splitlines() if x.strip().startswith("{")]
    assert rows, f"{page} shows no sample record"


def test_the_online_rl_guide_links_the_python_example():
    assert "](https://github.com/paratrain/paratrain/blob/main/examples/grpo.py)" in \
        _visible("docs/guides/online-rl.md")
    assert (REPO / "examples" / "grpo.py").is_file()


def _commands(page: str, marker_reason: str) -> list[list[str]]:
    return [args for b in doc_blocks() if b.page == page and b.lang == "bash"
            and b.reason.startswith(marker_reason) for args in b.commands()
            if args[:2] == ["paratrain", "train"]]


@pytest.fixture
def my_model(tmp_path, monkeypatch):
    """A folder the commands' model.path=./my-model names (the config checks read its
    config.json; nothing here loads weights)."""
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 400, "max_position_embeddings": 256}))
    monkeypatch.chdir(tmp_path)


def test_the_embedding_guides_commands_do_not_warn_about_their_warmup(my_model):
    """Its 5-step runs warned that the warmup (20) was as long as the run."""
    commands = _commands("docs/guides/embeddings.md", "tests/e2e/test_embedding.py")
    assert commands
    for args in commands:
        cfg = TrainConfig.from_yaml(None, args[2:])
        assert schedule_warnings(cfg.optim, cfg.trainer.max_steps) == [], args


def test_the_setfit_guides_epochs_are_what_it_trains(my_model):
    """trainer.epochs=1 did nothing: trainer.max_steps' default (200) won without a word."""
    (args,) = _commands("docs/guides/embeddings.md", "SetFit's")
    cfg = TrainConfig.from_yaml(None, args[2:])
    assert "trainer.epochs=1" in args and cfg.trainer.max_steps is None


def test_lora_on_two_gpus_has_a_command_and_gpu_2_means_two():
    (args,) = [a for b in doc_blocks() if b.page == "docs/guides/fine-tuning.md"
               and b.marker == "not run" for a in b.commands() if "trainer.devices=gpu:2" in a]
    assert "model.lora.r=8" in args
    assert len(parse_devices("gpu:2", gpus_visible=4)) == 2


def test_the_setfit_extra_installs_what_loading_a_result_needs():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11's")
    import tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0] for d in extras["setfit"]}
    assert {"setfit", "sentence-transformers", "scikit-learn"} <= names
    get_started = _visible("docs/get-started.md")
    for extra in extras:  # Get started's list of extras is the whole list
        assert f"`{extra}`" in get_started, extra
