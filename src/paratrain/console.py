"""What a person watching the run sees: one-line log messages and the progress bar, on global
rank 0 only (every other rank gets the same calls as no-ops, so callers carry no rank checks)."""

from __future__ import annotations

import sys
from typing import Any

from .dist import DistEnv


def log(env: DistEnv, msg: str) -> None:
    """One line on global rank 0's stderr (stdout stays clean for results)."""
    if env.is_master:
        print(f"[paratrain] {msg}", file=sys.stderr, flush=True)


class ProgressBar:
    """tqdm on global rank 0 only; a no-op elsewhere or when switched off."""

    def __init__(self, env: DistEnv, total: int, initial: int = 0, enabled: bool = True,
                 desc: str = "train", unit: str = "step"):
        self._bar = None
        self._env = env
        if env.is_master and enabled:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit,
                             dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)

    def write(self, msg: str) -> None:
        """A log line that does not tear the bar apart."""
        if self._bar is not None:
            self._bar.write(f"[paratrain] {msg}", file=sys.stderr)
        else:
            log(self._env, msg)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
