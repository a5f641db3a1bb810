"""Shared fixtures: a small real-text corpus, a shared token cache, and a bounded CLI runner.

Every run of the CLI goes through `run_cli`, which starts a new process group and kills the
whole group (workers included) when the time is up, so a hung distributed test fails instead of
hanging CI.
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

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """~0.4 MB of real text: the source of the standard library's `email` package."""
    src = Path(sysconfig.get_paths()["stdlib"]) / "email"
    dst = tmp_path_factory.mktemp("corpus") / "email"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("paratrain-cache")


def tiny_overrides(corpus_dir: Path, cache_dir: Path, **extra) -> list[str]:
    """A model and data small enough for a 10-step run in a couple of seconds."""
    base = {"model.preset": "tiny", "data.source": str(corpus_dir), "data.vocab_size": 384,
            "data.seq_length": 32, "data.cache_dir": str(cache_dir), "trainer.max_steps": 10,
            "trainer.log_every": 1, "trainer.eval_every": 1000, "trainer.batch_size": 4,
            "trainer.progress_bar": False, "optim.warmup_steps": 2,
            "distributed.timeout_s": 60}
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


def run_cli(args: list[str], cwd: Path, timeout: float = 180, env: dict | None = None,
            module: str = "paratrain", launcher: list[str] | None = None
            ) -> subprocess.CompletedProcess:
    """`python -m paratrain ARGS` (or LAUNCHER ARGS), killed with its workers after `timeout`."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC",
                                     "GROUP_RANK", "LOCAL_WORLD_SIZE", "SLURM_"))}
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **(env or {}))
    cmd = (launcher or [sys.executable, "-m", module]) + list(args)
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s\nstdout:\n{out}\n"
                    f"stderr:\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())
