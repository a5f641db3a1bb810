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


@pytest.fixture(scope="session")
def tiny_t5(tmp_path_factory) -> Path:
    """A tiny T5 (an encoder-decoder: pairs train it as seq2seq) with its tokenizer."""
    pytest.importorskip("transformers")
    from tests.e2e._preference_data import make_tiny_t5
    return built_once(tmp_path_factory, "t5", make_tiny_t5)


@pytest.fixture(scope="session")
def contract_inputs(tmp_path_factory, corpus_dir, cache_dir, preference_llama, preference_data,
                    tiny_t5):
    """What the task contract's rows read (tests/e2e/test_task_contract.py), once per session:
    every file that reads a row's runs gets the same inputs, so the same cached runs (the
    folder is the session's, shared by the xdist workers: tests/_shared.py)."""
    from tests.e2e.test_task_contract import Inputs
    return Inputs(preference_llama, preference_data,
                  built_once(tmp_path_factory, "contract", lambda folder: folder),
                  corpus_dir, cache_dir, tiny_t5)
