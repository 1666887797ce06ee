"""Host-side views of a sandbox for its tests: which processes its user owns, their states, and
files its background processes write. A module of its own (not conftest) so test files can import
it by a name no other test directory uses."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def host_pids_of(uid: int) -> list[int]:
    """Pids of every host process whose real uid is `uid` (sandbox processes run as their own uid)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                uid_line = next(line for line in f if line.startswith("Uid:"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        if int(uid_line.split()[1]) == uid:
            pids.append(int(name))
    return pids


def host_state(pid: int) -> str:
    """The one-letter scheduler state of a host process (R, S, T, ...)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def wait_for_file(path: Path, done: Callable[[str], bool], timeout: float = 20.0) -> str:
    """Poll a file a background sandbox process writes until `done(text)`; its text at the end."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        if done(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.02)
