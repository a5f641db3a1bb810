"""SetFit end to end (data.format=classify, trainer.objective=setfit, a tiny local Llama, mean
pooling), on the task contract's SetFit runs (tests/e2e/test_task_contract.py: the contrastive
phase on 1 worker and on 2 DDP workers runs the same steps and ends with the same weights; a
killed run resumes bit-identical): both runs' heads predict the same labels; `paratrain generate`
labels a text; the run's model/ folder loads with the `setfit` package, which predicts what
paratrain predicts."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.e2e._preference_data import labelled_rows

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900)]


@pytest.mark.slow
def test_setfit_heads_agree_generate_labels_and_the_setfit_package_predicts_the_same(
        tmp_path, tmp_path_factory, contract_inputs):
    pytest.importorskip("sklearn")
    from paratrain.tasks.embedding.setfit import predict
    from tests.e2e.test_task_contract import runs_of
    one, two = (run.dir for run in runs_of(tmp_path_factory, ("classify", "setfit"),
                                             contract_inputs))
    texts = [r["text"] for r in labelled_rows(8, 2)]
    ours = predict(one / "model", texts)
    assert predict(two / "model", texts) == ours and set(ours) <= {"fruit", "stone"}
    r = run_cli(["generate", str(one), "--prompt", texts[0]], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == ours[0], r.stderr[-2000:]
    setfit = pytest.importorskip("setfit")
    model = setfit.SetFitModel.from_pretrained(str(one / "model"), device="cpu")
    assert [str(p) for p in model.predict(texts)] == ours
