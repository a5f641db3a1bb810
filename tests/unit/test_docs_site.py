"""The docs site builds with `mkdocs build --strict`: a broken link, a page missing from the nav,
a config key the reference cannot show or an API name mkdocstrings cannot find fails here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytest.importorskip("mkdocs", reason="pip install -e '.[docs]' (scripts/test.sh does)")
pytest.importorskip("mkdocstrings")


@pytest.mark.timeout(300)
def test_mkdocs_build_strict(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode == 0, r.stderr[-5000:]
    reference = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "trainer.tensor_parallel" in reference and "Record field names" in reference
    assert "paratrain config show" in (tmp_path / "site" / "reference" / "cli" /
                                       "index.html").read_text()
