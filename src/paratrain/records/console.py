"""What a person watching the run sees: one-line log messages and the progress bar, on global
rank 0 only (every other rank gets the same calls as no-ops, so callers carry no rank checks)."""

from __future__ import annotations

import sys
from typing import Any

from ..dist import DistEnv

_open_bars = 0  # progress bars open in this process: log lines are written around them


def log(env: DistEnv, msg: str) -> None:
    """One line on global rank 0's stderr (stdout stays clean for results). Safe from any
    thread (snapshots commit from a background one): with a bar open, the line goes above it
    instead of onto it."""
    if env.is_master:
        if _open_bars:
            from tqdm.auto import tqdm
            tqdm.write(f"[paratrain] {msg}", file=sys.stderr)
        else:
            print(f"[paratrain] {msg}", file=sys.stderr, flush=True)


class ProgressBar:
    """tqdm on global rank 0 only; a no-op elsewhere or when switched off."""

    def __init__(self, env: DistEnv, total: int, initial: int = 0, enabled: bool = True,
                 desc: str = "train", unit: str = "step", leave: bool = True,
                 delay_s: float = 0.0):
        global _open_bars
        self._bar = None
        self._env = env
        if env.is_master and enabled:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit,
                             dynamic_ncols=True, file=sys.stderr, leave=leave,
                             delay=delay_s)  # delay: shown only if it lasts that long
            _open_bars += 1

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)

    def write(self, msg: str) -> None:
        """A log line that does not tear the bar apart."""
        log(self._env, msg)

    def close(self) -> None:
        global _open_bars
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            _open_bars -= 1
