"""The samplers' contract: world-size-independent global batches, exact resume, full eval."""

import pytest

from paratrain.data import EvalSampler, GlobalSampler


def batches(sampler, b):
    items = list(sampler)
    return [items[k * b:(k + 1) * b] for k in range(len(items) // b)]


@pytest.mark.parametrize("n", [50, 61])
def test_two_ranks_see_the_global_batches_of_one(n):
    W, b, seed = 2, 3, 7
    single = batches(GlobalSampler(n, 1, 0, seed, global_batch=b * W), b * W)
    per_rank = [batches(GlobalSampler(n, W, r, seed, global_batch=b * W), b) for r in range(W)]
    assert len(single) == len(per_rank[0]) == len(per_rank[1]) >= 8
    for k, global_batch in enumerate(single):
        union = per_rank[0][k] + per_rank[1][k]
        assert sorted(union) == sorted(global_batch)
        assert len(set(union)) == b * W


def test_epochs_and_seeds():
    s = GlobalSampler(100, seed=3)
    e0 = list(s)
    assert sorted(e0) == list(range(100))
    s.set_epoch(1)
    assert list(s) != e0
    again = GlobalSampler(100, seed=3)
    assert list(again) == e0
    assert list(GlobalSampler(100, seed=4)) != e0
    assert list(GlobalSampler(10, shuffle=False)) == list(range(10))


def test_position_resumes_exactly():
    full = list(GlobalSampler(57, 2, 1, seed=5, global_batch=4))
    s = GlobalSampler(57, 2, 1, seed=5, global_batch=4)
    s.load_state_dict({"epoch": 0, "seed": 5, "position": 10})
    assert len(s) == len(full) - 10 and list(s) == full[10:]
    restored = GlobalSampler(57, 2, 1, seed=0, global_batch=4)
    restored.load_state_dict(s.state_dict())
    restored.set_epoch(0)  # the same epoch again keeps the position
    assert list(restored) == full[10:]
    restored.set_epoch(1)  # a new epoch starts from its beginning
    assert len(restored) == len(full) and restored.state_dict()["position"] == 0


def test_drop_last_gives_equal_lengths():
    for n in (10, 11, 23):
        lens = {len(GlobalSampler(n, 3, r, global_batch=6)) for r in range(3)}
        assert lens == {n // 6 * 2}
    kept = [list(GlobalSampler(10, 3, r, drop_last=False)) for r in range(3)]
    assert [len(p) for p in kept] == [4, 3, 3] and sorted(sum(kept, [])) == list(range(10))


def test_global_batch_must_divide():
    with pytest.raises(ValueError):
        GlobalSampler(10, world_size=4, rank=0, global_batch=6)


@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_eval_sampler_covers_each_index_once(W):
    n = 4 * 7 + 3
    seen = [i for r in range(W) for i in EvalSampler(n, W, r)]
    assert sorted(seen) == list(range(n))
    assert sum(len(EvalSampler(n, W, r)) for r in range(W)) == n
