"""A memory cgroup per sandbox, when the machine lets root create one (cgroup v1 or v2).

Why a cgroup and not only RLIMIT_AS: an address-space rlimit is per process and makes allocations
fail (a MemoryError the program may swallow), so a sandbox running many processes could use many
times its budget and the host cannot tell a memory kill from a crash. A memory cgroup bounds every
process of the sandbox together, lets the kernel's OOM killer end the offender, and counts the
kills, so a run can report `killed_reason="memory"`. Where no memory cgroup can be created the
sandbox falls back to RLIMIT_AS (see `Sandbox.memory_enforcement`).

Sandbox cgroups live in their own `posttrain-sandbox` group at the top of the hierarchy, not under
the caller's cgroup, so a crashed caller never leaves children in a cgroup some other supervisor
wants to remove.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP = "posttrain-sandbox"


class MemoryCgroup:
    """One sandbox's memory cgroup: a limit, a count of OOM kills, and removal."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version

    @property
    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> MemoryCgroup | None:
        """The cgroup, or None when this machine offers no writable memory controller."""
        try:
            if (CGROUP_ROOT / "cgroup.controllers").exists():
                return cls._create_v2(name, limit_bytes)
            if (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists():
                return cls._create_v1(name, limit_bytes)
        except OSError:
            return None
        return None

    @classmethod
    def _create_v1(cls, name: str, limit_bytes: int) -> MemoryCgroup:
        parent = CGROUP_ROOT / "memory" / GROUP
        parent.mkdir(exist_ok=True)
        path = parent / name
        path.mkdir()
        cgroup = cls(path, 1)
        try:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            # Without swap accounting a process could page out past the limit instead of being killed.
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit_bytes))
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    @classmethod
    def _create_v2(cls, name: str, limit_bytes: int) -> MemoryCgroup:
        if "memory" not in (CGROUP_ROOT / "cgroup.controllers").read_text().split():
            raise OSError("cgroup v2 has no memory controller")
        if "memory" not in (CGROUP_ROOT / "cgroup.subtree_control").read_text().split():
            (CGROUP_ROOT / "cgroup.subtree_control").write_text("+memory")
        parent = CGROUP_ROOT / GROUP
        parent.mkdir(exist_ok=True)
        if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
            (parent / "cgroup.subtree_control").write_text("+memory")
        path = parent / name
        path.mkdir()
        cgroup = cls(path, 2)
        try:
            (path / "memory.max").write_text(str(limit_bytes))
            swap = path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    def oom_kills(self) -> int:
        """How many processes the OOM killer has ended in this cgroup so far."""
        name, key = ("memory.oom_control", "oom_kill") if self.version == 1 else ("memory.events", "oom_kill")
        for line in (self.path / name).read_text().splitlines():
            field, _, value = line.partition(" ")
            if field == key:
                return int(value)
        return 0

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone (they may take a moment to be freed)."""
        for _ in range(200):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.005)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)
