"""Packed windows and padded rows, read from a real cache."""

import pickle

import numpy as np
import pytest
import torch

from paratrain.config import DataConfig
from paratrain.data import PackedDataset, PaddedDataset, build_dataset, collate, prepare_data
from paratrain.data.dataset import IGNORE_INDEX


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    src = root / "src"
    src.mkdir()
    for i in range(12):
        (src / f"{i:02d}.txt").write_text(("word%d " % i) * (3 + 7 * i))
    cfg = DataConfig(source=str(src), vocab_size=300, val_fraction=0.2)
    return prepare_data(cfg, root / "cache", log=lambda _: None)


def test_packed_windows_are_contiguous_and_shifted(prepared):
    L = 16
    ds = PackedDataset(prepared, "train", L)
    stream = prepared.tokens("train")[:].astype(np.int64)
    assert len(ds) == (len(stream) - 1) // L
    for i in range(len(ds)):
        x, y = ds[i]["input_ids"], ds[i]["targets"]
        assert x.shape == y.shape == (L,) and x.dtype == torch.long
        assert torch.equal(x, torch.from_numpy(stream[i * L: i * L + L]))
        assert torch.equal(y, torch.from_numpy(stream[i * L + 1: i * L + L + 1]))
    rebuilt = torch.cat([ds[i]["input_ids"] for i in range(len(ds))])
    assert torch.equal(rebuilt, torch.from_numpy(stream[: len(ds) * L]))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_padded_rows(prepared):
    L = 40
    ds = PaddedDataset(prepared, "train", L, bot_id=1, eot_id=2, pad_id=0)
    assert len(ds) == prepared.meta["num_docs"]["train"]
    offsets = np.load(prepared.offsets_path("train"))
    stream = prepared.tokens("train")[:].astype(np.int64)
    saw_short = saw_cut = False
    for i in range(len(ds)):
        s = ds[i]
        x, y, mask = s["input_ids"], s["targets"], s["attention_mask"]
        assert x.shape == y.shape == mask.shape == (L,)
        doc = stream[offsets[i]: offsets[i + 1]]  # ends with the stored [EOT]
        row = np.concatenate([[1], doc])[: L + 1]
        n = len(row)
        assert x[0] == 1  # [BOT] first
        assert x[:n].tolist() == row[:L].tolist()
        assert (x[n:] == 0).all()  # right-padded
        assert mask.tolist() == [1] * min(n, L) + [0] * (L - min(n, L))
        assert y[: n - 1].tolist() == row[1:].tolist()
        assert (y[n - 1:] == IGNORE_INDEX).all()
        if len(doc) + 1 <= L + 1:
            saw_short = True
            assert y[n - 2] == 2 and (y == 2).sum() == 1  # one [EOT] after the doc, no dupes
        else:
            saw_cut = True
            assert mask.all() and (y != IGNORE_INDEX).all()
    assert saw_short and saw_cut


def test_padded_split_keeps_every_token_of_long_documents(prepared):
    """data.padded_overflow=split: a document longer than a row continues in more rows; over
    them, every token of every document is a target exactly once, in order."""
    L = 16
    cut = PaddedDataset(prepared, "train", L, bot_id=1, eot_id=2, pad_id=0)
    ds = PaddedDataset(prepared, "train", L, bot_id=1, eot_id=2, pad_id=0, overflow="split")
    offsets = np.load(prepared.offsets_path("train"))
    stream = prepared.tokens("train")[:].astype(np.int64)
    lengths = np.diff(offsets)
    assert len(ds) == sum(-(-n // L) for n in lengths) > len(cut) == len(lengths)
    n_long, extra = cut.overflow_summary()
    assert n_long == (lengths > L).sum() > 0 and extra == (lengths - L)[lengths > L].sum()
    targets: list[int] = []
    starts = []  # (row, input_ids) of each document's first row
    for i in range(len(ds)):
        s = ds[i]
        x, y, mask = s["input_ids"], s["targets"], s["attention_mask"]
        real = y != IGNORE_INDEX
        n = int(mask.sum())  # real input tokens, a prefix of the row
        assert mask[:n].all() and not mask[n:].any() and (x[n:] == 0).all()
        k = int(real.sum())  # real targets: a prefix too; n - 1, or n when the row is full
        assert real[:k].all() and not real[k:].any() and (k == n - 1 or k == n == L)
        assert torch.equal(x[1:n], y[:n - 1])  # targets are the inputs shifted by one
        if x[0] == 1:
            starts.append(i)
        targets += y[real].tolist()
    assert targets == stream.tolist()  # all documents, every token once, in order
    assert len(starts) == len(lengths)  # one [BOT] row per document, then its continuations
    assert [ds[i]["input_ids"].tolist() for i in starts] == \
        [cut[d]["input_ids"].tolist() for d in range(len(cut))]  # first rows as truncate's
    cfg = DataConfig(seq_length=L, format="padded", padded_overflow="split")
    assert len(build_dataset(prepared, "train", cfg, packed=False)) == len(ds)
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_build_dataset_collate_and_pickle(prepared):
    cfg = DataConfig(seq_length=8, format="padded")
    ds = build_dataset(prepared, "val", cfg, packed=False)
    assert isinstance(ds, PaddedDataset)
    batch = collate([ds[0], ds[1]])
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (2, 8)
    packed = build_dataset(prepared, "train", DataConfig(seq_length=8), packed=True)
    packed[0]  # opens the memmap
    clone = pickle.loads(pickle.dumps(packed))
    assert clone.tokens._maps == {} and torch.equal(clone[3]["targets"], packed[3]["targets"])
    loader = torch.utils.data.DataLoader(packed, batch_size=4, collate_fn=collate)
    first = next(iter(loader))
    assert first["input_ids"].shape == (4, 8) and "attention_mask" not in first
