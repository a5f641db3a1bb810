"""Progress lines for a long stage of data preparation."""

from __future__ import annotations

import threading
import time
from typing import Callable

PROGRESS_EVERY_S = 5.0  # a stage that runs longer says how far it is, this often


class Ticker:
    """`with Ticker(log, text):` a stage that runs longer than PROGRESS_EVERY_S logs
    `text(seconds so far)` that often, from a thread of its own (so a stage that is one blocking
    call, such as BPE training, is covered too); a short stage logs nothing extra."""

    def __init__(self, log: Callable[[str], None], text: Callable[[float], str],
                 every_s: float = PROGRESS_EVERY_S):
        self.log, self.text, self.every_s = log, text, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratrain-progress", daemon=True)

    def __enter__(self) -> "Ticker":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.log(self.text(time.perf_counter() - self._t0))
