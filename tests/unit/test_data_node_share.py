"""Two nodes that share data.cache_dir split a token cache's chunks and node 0 publishes it: the
same bytes as one node preparing it alone; a node that never delivers is named, in bounded time.
In-process: each "node" a thread on one folder (the real two-node run: test_multinode.py)."""

import threading
import time

import numpy as np
import pytest

from paratrain.config import DataConfig
from paratrain.data import prepare_data
from paratrain.data.node_share import (
    NodeShare,
    failed,
    forget_marker,
    mark_or_look,
    marker_path,
    wait_published,
)
from paratrain.errors import DataError

CFG = DataConfig(source="stdlib", vocab_size=512, max_bytes=400_000)


def on_nodes(cache, nnodes=2, timeout_s=60.0):
    results, logs = [None] * nnodes, [[] for _ in range(nnodes)]

    def node(r):
        share = NodeShare(r, nnodes, "job-1", shared=True, timeout_s=timeout_s, poll_s=0.02)
        results[r] = prepare_data(CFG, cache, log=logs[r].append, processes=1, nodes=share)

    threads = [threading.Thread(target=node, args=(r,)) for r in range(nnodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results, logs


def test_two_nodes_split_the_chunks_and_write_one_nodes_bytes(tmp_path):
    (p0, p1), (log0, log1) = on_nodes(tmp_path / "shared")
    alone = prepare_data(CFG, tmp_path / "alone", log=lambda m: None, processes=1)
    assert p0.dir == p1.dir  # one cache, published once
    per_node = p0.meta["chunks_per_node"]
    assert len(per_node) == 2 and min(per_node) > 0, per_node  # each node encoded a part
    assert any("prepared by 2 nodes in a shared cache" in m for m in log0), log0
    assert any(f"tokenized {per_node[0]} of {sum(per_node)} chunks on node 0" in m
               for m in log0), log0
    assert any(f"tokenized {per_node[1]} of {sum(per_node)} chunks on node 1" in m
               for m in log1), log1
    for split in ("train", "val"):
        assert np.array_equal(p0.tokens(split)[:], alone.tokens(split)[:]), split
        assert np.array_equal(np.load(p0.offsets_path(split)),
                              np.load(alone.offsets_path(split))), split
    assert p0.tokenizer_path.read_bytes() == alone.tokenizer_path.read_bytes()
    leftovers = [p.name for p in (tmp_path / "shared" / "data").iterdir()]
    assert leftovers == [p0.dir.name], leftovers  # the shared temp folder is gone


def test_a_node_that_never_delivers_is_named(tmp_path):
    share = NodeShare(0, 2, "job-2", shared=True, timeout_s=1.0, poll_s=0.02)
    with pytest.raises(DataError, match=r"node 1 did not deliver its part .* within 1 s"):
        prepare_data(CFG, tmp_path, log=lambda m: None, processes=1, nodes=share)
    assert list((tmp_path / "data").iterdir()) == []  # nothing half-published


def test_a_node_that_fails_or_node_0_that_stops_ends_the_wait_at_once(tmp_path):
    """Node 1's failure reaches node 0 (with why), node 0's stop reaches node 1: neither waits
    out its hour."""
    share0 = NodeShare(0, 2, "job-4", shared=True, timeout_s=60, poll_s=0.02)
    share1 = NodeShare(1, 2, "job-4", shared=True, timeout_s=60, poll_s=0.02)

    def node1_fails():  # as prepare_data reports an exception of node 1's part
        for _ in range(1000):
            tmps = list((tmp_path / "a" / "data").glob("*.tmp-job-4"))
            if tmps:
                return failed(tmps[0], share1, OSError("disk full"))
            time.sleep(0.01)

    t = threading.Thread(target=node1_fails)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(DataError, match="node 1 failed preparing its part .*: disk full"):
        prepare_data(CFG, tmp_path / "a", log=lambda m: None, processes=1, nodes=share0)
    t.join(timeout=10)

    def node0_stops():  # node 0 removes its temp folder when it fails
        tmp = tmp_path / "b" / "data" / "x.tmp-job-4"
        tmp.mkdir(parents=True)
        time.sleep(0.3)
        tmp.rmdir()

    t = threading.Thread(target=node0_stops)
    t.start()
    with pytest.raises(DataError, match="node 0 stopped preparing the shared data cache"):
        wait_published(tmp_path / "b" / "data" / "x", share1)
    t.join(timeout=10)
    assert time.monotonic() - t0 < 30


def test_node0s_marker_tells_a_shared_folder_from_a_private_one(tmp_path):
    assert mark_or_look(tmp_path / "a", 0, "job-3")  # node 0 writes it
    assert mark_or_look(tmp_path / "a", 1, "job-3")  # a node that shares the folder sees it
    assert not mark_or_look(tmp_path / "b", 1, "job-3")  # a folder of its own: no marker
    forget_marker(tmp_path / "a", "job-3")
    assert not marker_path(tmp_path / "a", "job-3").exists()
    line = NodeShare(0, 2, "job-3", shared=False).line("cache")
    assert "each node prepares its own copy: data.cache_dir=cache is not shared" in line


@pytest.mark.parametrize("same_folder", [True, False])
def test_the_nodes_decide_together_whether_the_folder_is_shared(tmp_path, same_folder):
    """Two nodes met over a real store (threads here): shared only when both see node 0's
    marker; the marker is gone afterwards."""
    from paratrain.launch.environment import free_port
    from paratrain.launch.nodes import join_nodes
    port, shares, groups = free_port(), [None, None], [None, None]

    def node(r):
        groups[r] = join_nodes("127.0.0.1", port, 2, r, 1, timeout_s=20)
        folder = tmp_path / ("shared" if same_folder or r == 0 else f"own{r}")
        shares[r] = groups[r].data_share(str(folder))

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [s.splits for s in shares] == [same_folder, same_folder], shares
    assert not list(tmp_path.glob("*/data/.nodes/*.json"))
    for g in groups:
        g.close()
