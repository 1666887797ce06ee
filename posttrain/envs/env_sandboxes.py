"""A pool of reusable sandboxes for RL episodes.

Starting a sandbox costs 150-300 ms on this machine (a new pid namespace, its root and pid 1);
restoring one to a snapshot costs about a millisecond. An RL iteration plays dozens of episodes
that each need a sandbox for a few tool calls, so episodes borrow a pooled sandbox, restored to an
empty workspace, or to a paused trajectory's snapshot when it resumes. Nothing of one episode is
visible to the next: restoring kills every process and resets /workspace, and the private /tmp
and /dev/shm (not part of snapshots) are emptied when a sandbox comes back to the pool.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from posttrain.envs.sandbox import Sandbox, SandboxError

# Starting a sandbox can fail for a moment (its pid 1 missing its start-up deadline on a loaded
# machine, a process limit briefly reached): a failed start is retried after a pause before the
# episode, and with it the stage, is given up. A start that fails every time is an error.
START_ATTEMPTS = 3
START_RETRY_PAUSE_S = 1.0

# /tmp and /dev/shm are the sandbox's own memory-backed mounts, outside /workspace and so outside
# snapshots; an agent could leave notes there for the next episode played in the same sandbox.
_CLEAR_SCRATCH = "rm -rf /tmp/* /tmp/.[!.]* /dev/shm/* 2>/dev/null; true"


class SandboxPool:
    """Lend sandboxes with given limits; `acquire(snapshot=None)` gives one whose workspace is
    empty (or equal to `snapshot`) and runs no process, `release` takes it back.

    limits: Sandbox keyword arguments (memory_mb, cpu_seconds, max_processes, network, ...).
    snapshot_root: where snapshots of pooled sandboxes are written (paused trajectories).
    max_idle: sandboxes kept open for reuse; more are closed when released.
    """

    def __init__(self, snapshot_root: Path, *, max_idle: int = 32, **limits: Any) -> None:
        self.snapshot_root = Path(snapshot_root)
        self.snapshot_root.mkdir(parents=True, exist_ok=True)
        self.limits = limits
        self.max_idle = max_idle
        self._idle: list[Sandbox] = []
        self._lent: set[int] = set()
        self._empty: str | None = None
        self.created = 0
        self.start_retries = 0  # failed starts that a later attempt made good

    def acquire(self, snapshot: str | None = None) -> Sandbox:
        """A sandbox with an empty workspace, or with `snapshot`'s files when given."""
        if self._idle:
            sandbox = self._idle.pop()
        else:
            sandbox = self._start()
            self.created += 1
            if self._empty is None:
                self._empty = sandbox.snapshot()
        try:
            sandbox.restore(snapshot or self._empty)
        except BaseException:
            sandbox.close()
            raise
        self._lent.add(id(sandbox))
        return sandbox

    def _start(self) -> Sandbox:
        attempt = 1
        while True:
            try:
                return Sandbox(**self.limits, snapshot_root=self.snapshot_root)
            except SandboxError as error:
                if attempt == START_ATTEMPTS:
                    raise SandboxError(
                        f"{error} (the start failed {START_ATTEMPTS} times in a row)"
                    ) from error
            self.start_retries += 1
            time.sleep(START_RETRY_PAUSE_S * attempt)
            attempt += 1

    def release(self, sandbox: Sandbox) -> None:
        """Take a lent sandbox back: its processes end and its files are dropped now."""
        self._lent.discard(id(sandbox))
        if sandbox.closed:
            return
        if len(self._idle) >= self.max_idle:
            sandbox.close()
            return
        try:
            sandbox.restore(self._empty)
            sandbox.run(_CLEAR_SCRATCH, timeout=10)
        except BaseException:
            sandbox.close()
            raise
        self._idle.append(sandbox)

    @property
    def lent(self) -> int:
        return len(self._lent)

    def close(self) -> None:
        """Close the idle sandboxes (lent ones are closed by their borrower or when collected)."""
        while self._idle:
            self._idle.pop().close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
