"""Every command and Python block of the README and the docs site runs as printed: the blocks of a
page one after the other, in a folder of its own that holds the repository's configs/ and
examples/ (what the commands name), with the real CLI and real worker processes, as a new user
copies them. A block that cannot run here says why on the line before its fence
(`<!-- not run: ... -->`), or names the test that runs it (`<!-- run by: ... -->`, for blocks
that need a folder built for them, such as the fine-tuning guide's tiny local model).

The runnable blocks are fast as printed (configs/tiny.yaml: 20 steps of a tiny model), so
nothing is shortened behind the reader's back. A `paratrain train` command printed on two pages
(the README's first example opens Get started too) is trained once per session and its run dirs
copied into the second page's folder, as tests/_runs.py shares a session's runs."""

from __future__ import annotations

import shutil
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.e2e._doc_blocks import Block, doc_blocks

BLOCKS = doc_blocks()
RUNNABLE: dict[str, list[Block]] = defaultdict(list)
for _b in BLOCKS:
    if _b.marker is None:
        RUNNABLE[_b.page].append(_b)


def test_every_block_runs_or_says_why():
    """A skipped block names its reason; a block run elsewhere names a test file that exists."""
    for b in BLOCKS:
        where = f"{b.page}:{b.line}"
        if b.marker == "not run":
            assert len(b.reason) > 10, f"{where}: say why it is not run"
        elif b.marker == "run by":
            test_file = b.reason.split(",")[0].split()[0]
            assert (REPO / test_file).is_file(), f"{where}: {test_file} does not exist"
    assert sum(len(v) for v in RUNNABLE.values()) >= 8, RUNNABLE.keys()
    assert "README.md" in RUNNABLE and "docs/get-started.md" in RUNNABLE


def test_the_readme_commands_work_without_activating_the_venv():
    """A fresh clone's reader has no `paratrain` on PATH until the venv is activated, which the
    README does not ask: its commands name .venv/bin/paratrain (Get started says to activate)."""
    for b in BLOCKS:
        if b.page == "README.md" and b.lang == "bash":
            for args in b.commands():
                assert args[0] != "paratrain", f"README.md:{b.line}: write .venv/bin/paratrain"


_TRAINED: dict[tuple[str, ...], tuple[Path, list[str]]] = {}  # command -> (cwd, run dirs made)


def _train_once(args: list[str], cwd: Path, where: str) -> None:
    """`paratrain train ...` as printed, or the run dirs the same command made on an earlier
    page, copied."""
    if tuple(args) in _TRAINED:
        first_cwd, made = _TRAINED[tuple(args)]
        for name in made:
            shutil.copytree(first_cwd / "runs" / name, cwd / "runs" / name)
        return
    before = {p.name for p in (cwd / "runs").glob("*")}
    _run_command(args, cwd, where, cached=False)
    _TRAINED[tuple(args)] = (cwd, sorted({p.name for p in (cwd / "runs").glob("*")} - before))


def _run_command(args: list[str], cwd: Path, where: str, cached: bool = True) -> None:
    if args[0] == ".venv/bin/paratrain":  # the same command, spelled without the venv active
        args = ["paratrain", *args[1:]]
    if cached and args[:2] == ["paratrain", "train"]:
        return _train_once(args, cwd, where)
    if args[0] in ("paratrain", ".venv/bin/paratrain"):
        r = run_cli(args[1:], cwd=cwd, timeout=400)
    elif args[0] in ("python", "python3"):
        r = run_cli(args[1:], cwd=cwd, timeout=400, launcher=[sys.executable])
    else:
        raise AssertionError(f"{where}: the docs test does not know how to run {args[0]!r}; "
                             "mark the block <!-- not run: why -->")
    assert r.returncode == 0, (where, args, r.stderr[-3000:])
    assert "Traceback" not in r.stdout + r.stderr, (where, args, r.stderr[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("page", sorted(RUNNABLE))
def test_page_blocks_run_as_printed(page, tmp_path):
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    for i, block in enumerate(RUNNABLE[page]):
        where = f"{page}:{block.line}"
        if block.lang == "bash":
            for args in block.commands():
                _run_command(args, tmp_path, where)
        else:
            script = tmp_path / f"block_{i}.py"
            script.write_text(block.code)
            _run_command(["python", script.name], tmp_path, where)
