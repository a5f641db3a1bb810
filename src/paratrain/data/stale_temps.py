"""The temporary folders of data preparations (`<fingerprint>.tmp-<pid>-<token>@<host>` under
data.cache_dir/data): a preparation builds its cache in one and renames it into place when it is
complete, and removes it if it fails. A process that is killed runs no cleanup, so its folder
stays (up to a whole cache's size); the next preparation removes it once its process is gone.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
from pathlib import Path
from typing import Callable

_TEMP = re.compile(r"^[0-9a-f]{24}\.tmp-(?P<pid>\d+)-[0-9a-f]{8}@(?P<host>.+)$")


def temp_name(fingerprint: str) -> str:
    """A preparation's temporary folder: its process id and host in the name, so a later
    preparation can tell whether it is still being written (`remove_stale_temps`)."""
    return f"{fingerprint}.tmp-{os.getpid()}-{secrets.token_hex(4)}@{_host()}"


def remove_stale_temps(data_dir: Path, log: Callable[[str], None]) -> None:
    """Remove the temporary folders of preparations killed before they finished (a killed
    process runs no cleanup): those made on this host by a process that is gone. A folder of
    another host (a shared filesystem) or of a live process is left alone."""
    host, removed = _host(), 0
    for folder in data_dir.iterdir():
        m = _TEMP.match(folder.name)
        if m and m["host"] == host and not _alive(int(m["pid"])):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    if removed:
        log(f"data: removed {removed} temporary folder(s) of preparations whose process is gone")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
