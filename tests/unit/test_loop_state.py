"""The loop's running sums between two log lines stay where they were computed (on a GPU: no host
sync per step, runtime/loop.py) and come out as the same floats the old per-step float() sums
gave: a snapshot saves plain JSON numbers."""

from __future__ import annotations

import json

import torch

from paratrain.runtime.loop_state import LoopState, add_counts, read_norm, unread


def test_sums_left_unread_add_up_to_the_same_floats():
    losses = [0.1, 0.2, 0.3, 1 / 3]  # float64 sums whose order and rounding show
    st, floats = LoopState(), 0.0
    for x in losses:
        st.loss_sum = st.loss_sum + unread(torch.tensor(x, dtype=torch.float64))
        st.count = st.count + unread(32)
        st.counts = add_counts(st.counts, {"rewards": unread(torch.tensor(x, dtype=torch.float32))})
        floats += x
    assert isinstance(st.loss_sum, torch.Tensor) and st.loss_sum.dtype == torch.float64
    snap = json.loads(json.dumps(st.to_snapshot()))  # plain JSON numbers
    assert snap["loss_sum"] == floats  # bit for bit: float64 adds either way
    assert snap["count"] == 128.0
    assert snap["counts"]["rewards"] == sum(float(torch.tensor(x, dtype=torch.float32))
                                            for x in losses)


def test_grad_norm_is_read_when_logged():
    assert read_norm(torch.tensor(2.5)) == 2.5
    assert unread(3) == 3.0 and isinstance(unread(3), float)
