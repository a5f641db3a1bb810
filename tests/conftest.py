"""Shared fixtures: a small real-text corpus, a shared token cache, a tiny Hugging Face Llama, and
the one CLI runner.

Every CLI process starts through `start_cli` (`run_cli` waits for it), in a session of its own
that `finish` kills whole (workers included) once it stops making progress (tests/_progress.py:
no CPU used for the allowed time), so a hung distributed test fails instead of hanging CI, and a
loaded machine's slow one does not. Input the CLI must refuse is checked in this process (`cli_error`,
through the same cli.main); a real process is kept for one error of each kind. Finished runs
that several tests read are trained once per session: tests/_runs.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests._progress import Stalled, session_pids, wait_while_progressing
from tests._shared import built_once

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """~0.4 MB of real text: the source of the standard library's `email` package."""
    src = Path(sysconfig.get_paths()["stdlib"]) / "email"
    return built_once(tmp_path_factory, "corpus", lambda folder: Path(shutil.copytree(
        src, folder / "email", ignore=shutil.ignore_patterns("__pycache__"))))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The tiny runs' data.cache_dir, one for the whole session (the cache is safe to share:
    racing builders both use whichever finished first, data/cache.py)."""
    return built_once(tmp_path_factory, "paratrain-cache", lambda folder: folder)


@pytest.fixture(scope="session", autouse=True)
def default_cache_of_the_session(tmp_path_factory):
    """Runs that leave data.cache_dir at its default ($XDG_CACHE_HOME/paratrain) cache in the
    session's own folder, inherited by every CLI process: never in the user's ~/.cache, and
    every session starts cold, so what a test sees does not depend on earlier sessions."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


# report.png (matplotlib: ~1.2 s of CPU per run) and TensorBoard events: off in the runs the
# tests build from their own arguments, on where a test reads them (tests/_runs.LOGGED,
# test_report.py) and in every command the docs print (run as printed)
QUIET_RECORDS = {"log.report": False, "log.tensorboard": False}


def tiny_overrides(corpus_dir: Path, cache_dir: Path, **extra) -> list[str]:
    """A model and data small enough for a 10-step run in a couple of seconds."""
    base = {"model.preset": "tiny", "data.source": str(corpus_dir), "data.vocab_size": 384,
            "data.seq_length": 32, "data.cache_dir": str(cache_dir), "trainer.max_steps": 10,
            "trainer.log_every": 1, "trainer.eval_every": 1000, "trainer.batch_size": 4,
            "trainer.progress_bar": False, "optim.warmup_steps": 2,
            "distributed.timeout_s": 60, **QUIET_RECORDS}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def make_hf_tokenizer(out: Path, texts: list[str], vocab_size: int = 400, bos: bool = True,
                      pad: bool = False) -> Path:
    """A pretrained-style tokenizer folder, made offline: byte-level BPE trained on `texts`, its
    special tokens added after the vocabulary (ids vocab_size.., not 0/1/2), saved with
    transformers' PreTrainedTokenizerFast.save_pretrained. `bos`: "<s>"/"</s>" (Llama-like),
    else "<|endoftext|>" as EOS alone (GPT-2-like); `pad`: a "<pad>" token too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    specials = ({"bos_token": "<s>", "eos_token": "</s>"} if bos else
                {"eos_token": "<|endoftext|>"})
    if pad:
        specials["pad_token"] = "<pad>"
    hf.add_special_tokens(list(specials.values()))
    tok = PreTrainedTokenizerFast(tokenizer_object=hf, **specials)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return out


def make_hf_llama(out: Path, texts: list[str], vocab_size: int = 384, bos: bool = True,
                  hidden_size: int = 64, max_positions: int = 64, seed: int = 0,
                  chat_template: str | None = None) -> Path:
    """A tiny 'pretrained' Hugging Face LlamaForCausalLM folder, made offline: random weights
    (`seed`; 2 layers, 4 heads, 2 KV heads, an MLP twice `hidden_size`) saved with
    save_pretrained beside a tokenizer from `make_hf_tokenizer` (no pad token; `chat_template`
    saved with it), its BOS/EOS ids in the model's config. The one builder of the tests' HF
    Llamas."""
    import torch
    import transformers
    make_hf_tokenizer(out, texts, vocab_size, bos=bos)
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    if chat_template is not None:
        tok.chat_template = chat_template
        tok.save_pretrained(out)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def corpus_texts(corpus_dir: Path) -> list[str]:
    """The corpus's documents as paratrain reads them."""
    from paratrain.data import resolve_corpus
    return list(resolve_corpus(str(corpus_dir)).documents())


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory, corpus_dir) -> Path:
    """One tiny Hugging Face Llama with its own tokenizer (Llama-like <s>/</s> at ids 384 and
    385, trained on the corpus), for the tests that need a pretrained model folder to train on
    the corpus or to refuse bad input with: built once, in this process."""
    pytest.importorskip("transformers")
    return built_once(tmp_path_factory, "hf", lambda folder: make_hf_llama(
        folder / "tiny-llama", corpus_texts(corpus_dir)))


@pytest.fixture(scope="session")
def pairs_llama(tmp_path_factory) -> Path:
    """`my-model/`: one tiny local "pretrained" Llama (tests/e2e/_tiny_model.py, 256 positions)
    with a tokenizer trained on 120 input->output pairs, built once for the fine-tuning tests
    that only read it (a test that changes it works on a copy)."""
    pytest.importorskip("transformers")
    from tests.e2e._tiny_model import make_pairs, make_tiny_llama
    texts = [r["input"] + " " + r["output"] for r in make_pairs(120)]
    return built_once(tmp_path_factory, "pairs-llama",
                      lambda folder: make_tiny_llama(folder / "my-model", texts))


def cli_env(extra: dict | None = None) -> dict:
    """The environment a CLI process gets: no launcher variables (a test may itself run under
    one), one thread per rank, unbuffered output."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC",
                                "GROUP_RANK", "LOCAL_WORLD_SIZE", "SLURM_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **(extra or {}))
    return env


def start_cli(args: list[str], cwd: Path, env: dict | None = None,
              launcher: list[str] | None = None, prefix: list[str] | None = None
              ) -> subprocess.Popen:
    """`python -m paratrain ARGS` (or LAUNCHER ARGS; PREFIX before it, e.g. `ip netns exec NS`)
    started in a session of its own, so the whole job (workers included) can be killed."""
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = (prefix or []) + (launcher or [sys.executable, "-m", "paratrain"]) + list(args)
    return subprocess.Popen(cmd, cwd=cwd, env=cli_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    """Wait for a started CLI while it works; once its whole session (the CLI and its workers)
    has made no progress for `timeout` s (tests/_progress.py: no CPU used, as a hung job), kill
    it and fail the test. A loaded machine stretches the wait instead of failing it."""
    got: list = []

    def ended(poll_s: float) -> bool:
        try:
            got.extend(proc.communicate(timeout=poll_s))
            return True
        except subprocess.TimeoutExpired:  # (communicate again loses no output)
            return False
    try:
        wait_while_progressing(ended, lambda: session_pids(proc.pid), stall_s=timeout)
    except Stalled as e:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, proc.args))}: {e}\n"
                    f"stdout:\n{out[-2000:]}\nstderr:\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, *got)


def finish_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for several CLIs (the nodes of one job) while they work; once they make no progress
    for `timeout` s together, kill every one and fail with what each printed."""
    got: dict[int, tuple] = {}

    def ended(poll_s: float) -> bool:
        for i, p in enumerate(procs):
            if i not in got:
                try:
                    out, err = p.communicate(timeout=poll_s / len(procs))
                    got[i] = (p.returncode, out, err)
                except subprocess.TimeoutExpired:
                    pass
        return len(got) == len(procs)
    try:
        wait_while_progressing(ended, lambda: [q for p in procs for q in session_pids(p.pid)],
                               stall_s=timeout)
    except Stalled as e:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        logs = "\n".join(f"--- node {i}\n{p.communicate()[1][-2000:]}"
                         for i, p in enumerate(procs))
        pytest.fail(f"nodes: {e}\n{logs}")
    return [got[i] for i in range(len(procs))]


def run_cli(args: list[str], cwd: Path, timeout: float = 180, env: dict | None = None,
            launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """`python -m paratrain ARGS` (or LAUNCHER ARGS) to the end, killed with its workers after
    `timeout`."""
    return finish(start_cli(args, cwd, env=env, launcher=launcher), timeout)


def one_error_line(err: str) -> str:
    """The one `paratrain: error:` line a refused command printed (and no traceback)."""
    lines = [x for x in err.strip().splitlines() if x.startswith("paratrain: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def cli_run(capsys, argv: list[str]) -> subprocess.CompletedProcess:
    """`paratrain ARGV` run in this process (cli.main, what the console entry point calls): its
    exit code and what it printed, as `run_cli` returns them. For the commands that read a
    finished run (generate, checkpoint, report, config) and one-device runs (which the CLI
    trains in its own process anyway): a process of their own would cost a Python and torch
    start-up each and test nothing more (test_errors.py runs the entry point in a real
    process). A run sets this process's torch threads for itself: the tests after it get
    theirs back."""
    import torch

    from paratrain import cli
    capsys.readouterr()  # what the test printed before is not this command's
    threads = torch.get_num_threads()
    try:
        code = cli.main([str(a) for a in argv])
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["paratrain", *argv], code, out, err)


def cli_error(capsys, argv: list[str], only_line: bool = False) -> str:
    """`paratrain ARGV` run in this process (cli.main, what the console entry point calls) for
    input it must refuse: exit code 2, no traceback, one line saying so (progress lines may come
    first; `only_line`: nothing else at all). Returns that line. Cheaper than a process: one real
    process per kind of error checks the exit code of the entry point itself (test_errors.py)."""
    return cli_refusal(capsys, argv, only_line)[0]


def cli_refusal(capsys, argv: list[str], only_line: bool = False) -> tuple[str, str]:
    """`cli_error`, and all the command printed on stderr (to check what it did not do); `only_line`
    allows the line a train command prints before its slow imports, nothing else."""
    from paratrain import cli
    capsys.readouterr()  # what the test printed before is not this command's
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err
    lines = [x for x in err.strip().splitlines()  # (every train says it lives, first)
             if not x.startswith("[paratrain] config checked")]
    errors = lines if only_line else [x for x in lines if not x.startswith("[paratrain] ")]
    assert len(errors) == 1, err
    assert errors[0].startswith("paratrain: error: ")
    return errors[0], err


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_runs_agree(a: Path, b: Path, keys: tuple[str, ...] = ("loss",),
                      tol: float = 1e-5) -> list[dict]:
    """Two finished runs logged the same steps with the same figures (within `tol`) and ended
    with the same weights (model/model.safetensors, within `tol`); a's metrics rows."""
    from safetensors.torch import load_file
    rows_a, rows_b = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for x, y in zip(rows_a, rows_b):
        for key in keys:
            assert abs(x[key] - y[key]) <= tol, (x["step"], key, x[key], y[key])
    w_a, w_b = (load_file(str(run / "model" / "model.safetensors")) for run in (a, b))
    assert w_a.keys() == w_b.keys()
    assert max((w_a[k] - w_b[k]).abs().max().item() for k in w_a) <= tol
    return rows_a


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())
