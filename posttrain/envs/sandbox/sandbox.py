"""`Sandbox`: a persistent, isolated Linux environment an agent's commands run in.

Agent rollouts in RL outlive one command and one iteration: a partial rollout pauses with its
environment and resumes next iteration, a reward is computed on a fork without touching the
trajectory, and an agent must not reach the host. This class gives that with what a root process
on a plain Linux machine has: util-linux `unshare` (mount, pid, net, ipc and uts namespaces), bind
mounts, rlimits, a memory cgroup where one can be created, and directory snapshots. A microVM
backend (K3 used Firecracker) can implement the same interface; docs/sandbox.md says how.

Lifecycle: the constructor starts the sandbox's pid 1 (`init_process.py`), which stays up until
`close()`; each `run` forks a command inside the namespaces as an unprivileged per-sandbox user.
Commands started in the background keep running between runs. Snapshots cover /workspace only
(files, not processes or memory); `restore` ends every process before resetting the files, and
`fork` copies files, never processes.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.envs.sandbox import init_process
from posttrain.envs.sandbox.cgroup import MemoryCgroup
from posttrain.envs.sandbox.snapshots import (
    Signature,
    copy_workspace,
    read_files,
    read_manifest,
    restore_snapshot,
    settle_time_ns,
    signatures,
    write_snapshot,
)

WORKSPACE = "/workspace"
DEFAULT_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKSPACE,
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "USER": "sandbox",
    "LOGNAME": "sandbox",
    # A tool's output is part of the episode: Python's per-process string hashing would print a set
    # in another order in every run (with ASLR off in the child, init_process, object reprs and
    # id() repeat too), so a rerun or a resumed step would see other tokens and train otherwise.
    "PYTHONHASHSEED": "0",
}
# Sandbox paths a read-only mount may not cover: they are the sandbox's own.
RESERVED_TARGETS = ("/", WORKSPACE, "/tmp", "/proc", "/dev", "/etc")
# Per-sandbox uids come from a range no distribution hands out, so files and RLIMIT_NPROC counts
# of one sandbox never mix with a real user's or another sandbox's.
UID_RANGE = (1_000_000_000, 2_000_000_000)
STARTUP_TIMEOUT_S = 20.0
# How long past a run's own timeout the host waits for pid 1 before declaring the sandbox dead.
REPLY_GRACE_S = 10.0
CONTROL_TIMEOUT_S = 30.0


class SandboxError(RuntimeError):
    """The sandbox cannot do what was asked (closed, paused, failed to start, pid 1 died)."""


@dataclass(frozen=True)
class RunResult:
    """What one command did.

    exit_code: the command's exit status; -N when signal N killed it (as in `subprocess`); 127 when
      the command does not exist, 126 when it could not be started.
    stdout / stderr: UTF-8 decoded with replacement characters; head and tail kept past
      `max_output_bytes`, with a marker saying how many bytes were omitted.
    timed_out: the wall-clock timeout ended the command's process group.
    killed_reason: "timeout", "memory" (the OOM killer ended it at the sandbox's memory limit),
      "cpu" (RLIMIT_CPU) or "file_size" (RLIMIT_FSIZE); None when it ended on its own.
    wall_seconds / cpu_seconds: elapsed time and the CPU time of the command and its waited-for
      children.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    killed_reason: str | None = None
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Sandbox:
    """An isolated, persistent environment: run, pause/resume, snapshot/restore, fork, close.

    memory_mb: memory of all the sandbox's processes together (memory cgroup; where none can be
      created, an address-space limit per process instead, see `memory_enforcement`).
    cpu_seconds: CPU time of each process (RLIMIT_CPU).
    max_processes: processes and threads of the sandbox together (RLIMIT_NPROC of its own uid).
    network: False gives a network namespace with only a loopback of its own.
    mounts: host path -> sandbox path, mounted read-only (tools, a virtualenv, documents).
    env: environment added to every command's.
    timeout: default wall-clock seconds of one `run`.
    max_output_bytes: stdout and stderr kept per run, each.
    max_file_mb: the largest file a process may write (RLIMIT_FSIZE; SIGXFSZ past it). It also
      bounds what one file costs a snapshot: a sparse file is copied dense.
    tmp_mb: size of the private /tmp (memory-backed, not part of snapshots).
    workspace_mb: size of /workspace, all files together (a size-capped tmpfs in the sandbox's
      mount namespace, so nothing an agent writes lands on the host's disk; memory-backed: with a
      memory cgroup the pages the agent writes count toward memory_mb too). Writes past it fail
      with ENOSPC. Host code reaches it at `workspace` (/proc/<init pid>/root/workspace).
    base_dir: where the sandbox's host directory is made (default: the system temp dir).
    snapshot_root: where `snapshot()` writes (default: <temp dir>/posttrain-sandbox-snapshots).
    """

    def __init__(
        self,
        memory_mb: int = 512,
        cpu_seconds: int = 30,
        max_processes: int = 64,
        network: bool = False,
        *,
        mounts: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 30.0,
        max_output_bytes: int = 1 << 20,
        max_file_mb: int = 1024,
        tmp_mb: int = 64,
        workspace_mb: int = 1024,
        base_dir: str | os.PathLike[str] | None = None,
        snapshot_root: str | os.PathLike[str] | None = None,
    ) -> None:
        _check_limits(
            memory_mb=memory_mb,
            cpu_seconds=cpu_seconds,
            max_processes=max_processes,
            max_output_bytes=max_output_bytes,
            max_file_mb=max_file_mb,
            tmp_mb=tmp_mb,
            workspace_mb=workspace_mb,
        )
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.config: dict[str, Any] = {
            "memory_mb": memory_mb,
            "cpu_seconds": cpu_seconds,
            "max_processes": max_processes,
            "network": network,
            "mounts": _check_mounts(mounts or {}),
            "env": dict(env or {}),
            "timeout": timeout,
            "max_output_bytes": max_output_bytes,
            "max_file_mb": max_file_mb,
            "tmp_mb": tmp_mb,
            "workspace_mb": workspace_mb,
        }
        _check_host()
        self.name = f"sb-{secrets.token_hex(6)}"
        self.uid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
        self.snapshot_root = Path(
            snapshot_root or Path(tempfile.gettempdir()) / "posttrain-sandbox-snapshots"
        )
        self.snapshot_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._base_dir = base_dir
        self._lock = threading.RLock()
        self._paused = False
        self._snapshot_count = 0
        self._parent_snapshot: Path | None = None
        self._baseline: dict[str, Signature] = {}
        self._settle_ns = 0

        self._dir = Path(tempfile.mkdtemp(prefix=f"posttrain-{self.name}-", dir=base_dir))
        (self._dir / "root").mkdir()
        self._cgroup = MemoryCgroup.create(self.name, memory_mb << 20)
        try:
            self._sock, self._proc = self._start_init()
        except BaseException:
            if self._cgroup is not None:
                self._cgroup.remove()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._release = weakref.finalize(
            self, _release, os.getpid(), self._proc, self._sock, self._cgroup, self._dir
        )
        reply = self._receive(STARTUP_TIMEOUT_S, "start")
        if "error" in reply:
            self.workspace = self._dir / "workspace"  # never made: close() has nothing to read
            self.close()
            raise SandboxError(f"sandbox {self.name}: {reply['error']}")
        # The workspace tmpfs exists only in the sandbox's mount namespace; root on the host sees
        # it through the init process's root.
        self.workspace = Path(f"/proc/{reply['pid']}/root{WORKSPACE}")

    @property
    def memory_enforcement(self) -> str:
        """How memory_mb is enforced. With "cgroup-v1" or "cgroup-v2" it bounds all processes
        together and OOM kills are reported; with "rlimit" it bounds each process's address space
        (allocations fail instead)."""
        return f"cgroup-v{self._cgroup.version}" if self._cgroup else "rlimit"

    @property
    def closed(self) -> bool:
        return not self._release.alive

    @property
    def paused(self) -> bool:
        return self._paused

    def run(
        self,
        command: str | Sequence[str],
        timeout: float | None = None,
        *,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str = WORKSPACE,
    ) -> RunResult:
        """Run `command` (a shell string for /bin/sh -c, or an argv list) and wait for it.

        Returns when the command exits or its `timeout` (seconds, default the sandbox's) ends its
        process group. Processes it started in the background keep running; output they write
        after this returns is discarded.
        """
        timeout = self.config["timeout"] if timeout is None else timeout
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if isinstance(command, str):
            argv = ["/bin/sh", "-c", command]
        else:
            argv = [str(arg) for arg in command]
            if not argv:
                raise ValueError("command is an empty list; give a program and its arguments")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        with self._lock:
            self._check_open()
            if self._paused:
                raise SandboxError(f"sandbox {self.name} is paused: call resume() before run()")
            self._settle()
            oom_before = self._cgroup.oom_kills() if self._cgroup else 0
            reply = self._request(
                {
                    "op": "run",
                    "argv": argv,
                    "cwd": cwd,
                    "timeout": float(timeout),
                    "env": {**DEFAULT_ENV, **self.config["env"], **(env or {})},
                    "stdin": base64.b64encode(data).decode() if data is not None else None,
                    "max_output": self.config["max_output_bytes"],
                },
                timeout + REPLY_GRACE_S,
            )
            oom_killed = self._cgroup is not None and self._cgroup.oom_kills() > oom_before
        exit_code = reply["exit_code"]
        return RunResult(
            exit_code=exit_code,
            stdout=base64.b64decode(reply["stdout"]).decode("utf-8", errors="replace"),
            stderr=base64.b64decode(reply["stderr"]).decode("utf-8", errors="replace"),
            timed_out=reply["timed_out"],
            killed_reason=self._killed_reason(reply, oom_killed),
            wall_seconds=reply["wall_seconds"],
            cpu_seconds=reply["cpu_seconds"],
        )

    def pause(self) -> None:
        """Stop every process of the sandbox (SIGSTOP); they keep their state. Idempotent."""
        with self._lock:
            self._check_open()
            if self._paused:
                return
            reply = self._request({"op": "stop"}, CONTROL_TIMEOUT_S)
            self._paused = True
            if reply["running"]:
                self.resume()
                raise SandboxError(
                    f"sandbox {self.name}: {reply['running']} processes did not stop within 2 s"
                )

    def resume(self) -> None:
        """Continue every process stopped by `pause()`. Idempotent."""
        with self._lock:
            self._check_open()
            if not self._paused:
                return
            self._settle()
            self._request({"op": "continue"}, CONTROL_TIMEOUT_S)
            self._paused = False

    def workspace_files(self, max_bytes: int = 1 << 20) -> dict[str, bytes]:
        """Relative path -> content (first `max_bytes`) of every regular file in /workspace.

        The safe way for host code (verifiers, rewards) to look at an agent's files: reading
        `workspace` directly with ordinary path calls follows symlinks the agent may have planted
        to host files, as root. This never follows one, and pauses the sandbox while reading.
        """
        with self._lock:
            self._check_open()
            was_paused = self._paused
            self.pause()
            try:
                return read_files(self.workspace, max_bytes)
            finally:
                if not was_paused:
                    self.resume()

    def snapshot(self) -> str:
        """Write the workspace's files to a new directory under `snapshot_root`; return its path.

        Incremental: files unchanged since the previous snapshot (or restore) are hard links to its
        copies. The sandbox is paused while copying so the snapshot is consistent.
        """
        with self._lock:
            self._check_open()
            was_paused = self._paused
            self.pause()
            try:
                self._snapshot_count += 1
                dest = self.snapshot_root / f"{self.name}-{self._snapshot_count:04d}-{secrets.token_hex(3)}"
                entries = write_snapshot(
                    self.workspace, dest, self._parent_snapshot, self._baseline, self.config
                )
                self._parent_snapshot, self._baseline = dest, signatures(entries)
                self._settle_ns = settle_time_ns(entries)
            finally:
                if not was_paused:
                    self.resume()
            return str(dest)

    def restore(self, snapshot: str | os.PathLike[str]) -> None:
        """End every process, then make the workspace equal to `snapshot` (a path from `snapshot()`,
        of this or any sandbox, alive or not). The sandbox is running (not paused) afterwards."""
        path = Path(snapshot).absolute()
        read_manifest(path)
        with self._lock:
            self._check_open()
            self._request({"op": "kill"}, CONTROL_TIMEOUT_S)
            self._paused = False
            keep = self._baseline if path == self._parent_snapshot else {}
            entries = restore_snapshot(path, self.workspace, self.uid, keep)
            self._parent_snapshot, self._baseline = path, signatures(entries)
            self._settle_ns = settle_time_ns(entries)

    def fork(self) -> Sandbox:
        """A new, independent sandbox with a copy of this one's workspace and the same limits.

        Processes are not forked: the child starts with none running.
        """
        with self._lock:
            self._check_open()
            child = Sandbox(**self.config, base_dir=self._base_dir, snapshot_root=self.snapshot_root)
            was_paused = self._paused
            try:
                self.pause()
                copy_workspace(self.workspace, child.workspace, child.uid)
            except BaseException:
                child.close()
                raise
            finally:
                if not was_paused and not self.closed:
                    self.resume()
            return child

    @classmethod
    def from_snapshot(cls, snapshot: str | os.PathLike[str], **overrides: Any) -> Sandbox:
        """A new sandbox with the limits recorded in `snapshot` (unless overridden) and its files.
        Its own snapshots go next to `snapshot` unless `snapshot_root` is given."""
        path = Path(snapshot).absolute()
        settings = {**read_manifest(path)["config"], "snapshot_root": path.parent, **overrides}
        sandbox = cls(**settings)
        try:
            sandbox.restore(path)
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    def close(self) -> None:
        """End every process the sandbox started and delete its workspace. Idempotent."""
        with self._lock:
            self._release()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "paused" if self._paused else "running"
        return f"Sandbox({self.name}, {state}, workspace={self.workspace})"

    def _start_init(self) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        host_sock, init_sock = socket.socketpair()
        limit_nproc = self.config["max_processes"]
        rlimits = {
            "RLIMIT_CPU": [self.config["cpu_seconds"], self.config["cpu_seconds"] + 1],
            "RLIMIT_NPROC": [limit_nproc, limit_nproc],
            "RLIMIT_CORE": [0, 0],
            "RLIMIT_FSIZE": [self.config["max_file_mb"] << 20] * 2,
        }
        if self._cgroup is None:
            rlimits["RLIMIT_AS"] = [self.config["memory_mb"] << 20] * 2
        init_config = {
            "root": str(self._dir / "root"),
            "workspace_mb": self.config["workspace_mb"],
            "uid": self.uid,
            "network": self.config["network"],
            # Sorted by sandbox path so a mount nested in another is made after it.
            "mounts": sorted(self.config["mounts"].items(), key=lambda mount: mount[1]),
            "tmp_mb": self.config["tmp_mb"],
            "rlimits": rlimits,
            "cgroup_procs": self._cgroup.procs_file if self._cgroup else None,
        }
        namespaces = [
            "--mount",
            "--pid",
            "--fork",
            "--uts",
            "--ipc",
            "--propagation",
            "private",
            "--kill-child",
        ]
        if not self.config["network"]:
            namespaces.append("--net")
        command = [
            "unshare",
            *namespaces,
            sys.executable,
            "-I",
            "-S",
            init_process.__file__,
            str(init_sock.fileno()),
            json.dumps(init_config),
        ]
        with open(self._dir / "init.log", "wb") as log:
            proc = subprocess.Popen(
                command,
                pass_fds=[init_sock.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        init_sock.close()
        return host_sock, proc

    def _request(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            init_process.send_message(self._sock, message)
        except OSError as exc:
            self._fail(f"cannot reach its pid 1 ({exc})")
        reply = self._receive(timeout, message["op"])
        if "error" in reply:
            raise SandboxError(f"sandbox {self.name}: {reply['error']}")
        return reply

    def _receive(self, timeout: float, what: str) -> dict[str, Any]:
        self._sock.settimeout(timeout)
        try:
            reply = init_process.recv_message(self._sock)
        except TimeoutError:
            self._fail(f"pid 1 did not answer {what!r} within {timeout:.0f} s")
        if reply is None:
            self._fail(f"pid 1 exited during {what!r}")
        return reply

    def _fail(self, what: str) -> Any:
        log = self._dir / "init.log"
        detail = log.read_text(errors="replace").strip()[-2000:] if log.exists() else ""
        self.close()
        raise SandboxError(
            f"sandbox {self.name} closed: {what}" + (f"; its log says: {detail}" if detail else "")
        )

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"sandbox {self.name} is closed")

    def _settle(self) -> None:
        """Let the file-system clock pass the last recorded ctime before processes run again."""
        wait_ns = self._settle_ns - time.time_ns()
        if wait_ns > 0:
            time.sleep(wait_ns / 1e9)

    def _killed_reason(self, reply: dict[str, Any], oom_killed: bool) -> str | None:
        code = reply["exit_code"]
        # A shell reports a child killed by signal N as 128 + N.
        killed_by = {-code} if code < 0 else {code - 128} if code > 128 else set()
        if reply["timed_out"]:
            return "timeout"
        if oom_killed and signal.SIGKILL in killed_by:
            return "memory"
        # SIGXCPU comes from the soft RLIMIT_CPU, SIGKILL from the hard one a second later. The
        # accounted CPU time can trail the limit by a scheduler tick, hence the margin.
        if signal.SIGXCPU in killed_by or (
            signal.SIGKILL in killed_by and reply["cpu_seconds"] >= self.config["cpu_seconds"] - 0.5
        ):
            return "cpu"
        if signal.SIGXFSZ in killed_by:
            return "file_size"
        return None


def _release(
    owner_pid: int,
    proc: subprocess.Popen[bytes],
    sock: socket.socket,
    cgroup: MemoryCgroup | None,
    directory: Path,
) -> None:
    """Close pid 1's socket (it then kills every process and exits), wait, and clean up the host.

    In a process forked from the owner (a multiprocessing worker) only the inherited socket copy is
    closed: the sandbox is the owner's to end.
    """
    sock.close()
    if os.getpid() != owner_pid:
        return
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()  # unshare --kill-child takes pid 1, and with it the whole pid namespace
        proc.wait()
    if cgroup is not None:
        cgroup.remove()
    shutil.rmtree(directory, ignore_errors=True)


def _check_limits(**limits: int) -> None:
    for name, value in limits.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if limits["memory_mb"] < 16:
        raise ValueError(
            f"memory_mb must be at least 16 (a shell needs a few MiB), got {limits['memory_mb']}"
        )


def _check_mounts(mounts: Mapping[str, str]) -> dict[str, str]:
    checked = {}
    for host, target in mounts.items():
        host_path, target_path = os.path.abspath(host), os.path.normpath(target)
        if not os.path.exists(host_path):
            raise ValueError(f"mounts: host path {host!r} does not exist")
        if not target_path.startswith("/"):
            raise ValueError(
                f"mounts: sandbox path {target!r} for {host!r} must be absolute, e.g. /opt/tools"
            )
        for reserved in RESERVED_TARGETS:
            if target_path == reserved or (reserved != "/" and target_path.startswith(reserved + "/")):
                raise ValueError(
                    f"mounts: sandbox path {target!r} is inside {reserved}, which the sandbox owns; "
                    f"mount under /opt or /mnt instead"
                )
        checked[host_path] = target_path
    return checked


def _check_host() -> None:
    if os.geteuid() != 0:
        raise SandboxError(
            "sandboxes need root (mount, pid and network namespaces, a per-sandbox uid); "
            "run as root, e.g. in the CI container"
        )
    if shutil.which("unshare") is None:
        raise SandboxError("util-linux `unshare` is not on PATH; install util-linux")
