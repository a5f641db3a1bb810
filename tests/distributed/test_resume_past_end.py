"""A run resumed from a snapshot at or past its last step (trainer.max_steps lowered) trains
nothing and says so in one line, instead of ending at once without a word."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.distributed._snapshot_helpers import args_for, interrupted_copy, reference_run

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_a_resume_past_max_steps_says_so(tmp_path, tmp_path_factory, corpus_dir, cache_dir):
    ref = reference_run(tmp_path_factory, corpus_dir, cache_dir)
    interrupted_copy(ref, tmp_path / "runs" / "past", keep_until=8)
    r = run_cli(args_for(corpus_dir, cache_dir, "past", **{"trainer.max_steps": 6}),
                cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if "nothing to train" in x]
    assert len(lines) == 1, r.stderr[-3000:]
    assert ("nothing to train: the snapshot is at step 8 and this run ends at step 6 "
            "(trainer.max_steps=6); raise trainer.max_steps to train on") in lines[0]
