"""A rank that stopped because another rank was signalled waits for a signal of its own
(`await_stop_signal`): in an elastic job its agent's SIGTERM says a node joined (the agent
restarts it), where returning at once would leave the node at the exit barrier for good."""

import os
import signal
import threading
import time

from paratrain.launch.preemption import await_stop_signal


def test_a_signal_that_comes_is_noted_and_the_handlers_are_put_back():
    before = signal.getsignal(signal.SIGUSR1)
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    t0 = time.monotonic()
    assert await_stop_signal(10.0)
    assert time.monotonic() - t0 < 5.0  # at once, not at the timeout
    assert signal.getsignal(signal.SIGUSR1) is before


def test_no_signal_within_the_wait():
    t0 = time.monotonic()
    assert not await_stop_signal(0.3)
    assert 0.3 <= time.monotonic() - t0 < 5.0
