"""Fixtures shared by the end-to-end files: what several of them build alike is built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._shared import built_once


@pytest.fixture(scope="session")
def preference_llama(tmp_path_factory) -> Path:
    """The tiny causal Llama of the preference tests (DPO, reward models): one model folder
    that they read and never change."""
    pytest.importorskip("transformers")
    from tests.e2e._preference_data import make_preference_llama
    return built_once(tmp_path_factory, "preference-llama", make_preference_llama)


@pytest.fixture(scope="session")
def preference_data(tmp_path_factory) -> tuple[Path, Path]:
    """Their train.jsonl and val.jsonl (`write_preference_data`)."""
    from tests.e2e._preference_data import write_preference_data
    return built_once(tmp_path_factory, "preference-data", write_preference_data)


@pytest.fixture(scope="session")
def preference_bert(tmp_path_factory) -> Path:
    """A tiny BERT-like encoder (with its pooler) for the embedding and SetFit tests."""
    pytest.importorskip("transformers")
    from tests.e2e._preference_data import make_tiny_bert
    return built_once(tmp_path_factory, "preference-bert", make_tiny_bert)
