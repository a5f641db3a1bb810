"""KTO end to end (trainer.objective=kto on preference pairs, each pair a desirable and an
undesirable example): the KL estimate and rewards start at zero, on the task contract's runs
(tests/e2e/test_task_contract.py: 1 worker and 2 DDP workers with the same global batch run the
same steps, the KL estimate summed over both workers' batches; a run that died after a snapshot,
rerun by the same command, ends bit-identical)."""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900)]


@pytest.mark.slow
def test_the_kl_estimate_and_rewards_start_at_zero_and_both_workers_count(
        tmp_path_factory, contract_inputs):
    """On the contract's KTO runs (tests/e2e/test_task_contract.py: 1 and 2 workers agree, a
    killed run resumes bit-identical): policy = reference at step 1, so no reward, KL 0, each
    loss half its weight; later estimates are positive, made from both workers' batches."""
    from tests.e2e.test_task_contract import runs_of
    one, _ = runs_of(tmp_path_factory, ("preference", "kto"), contract_inputs)
    rows = read_metrics(one.dir)
    first = rows[0]
    assert first["kl"] == 0.0 and first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    assert 0.5 <= first["loss"] <= 0.75 and all(r["kl"] >= 0 for r in rows)
    assert any(r["kl"] > 0 for r in rows)
