"""Pid 1 of a sandbox: builds the sandbox's file system view, then starts and reaps its commands.

Why a long-lived init process: persistence is the point of these sandboxes. A command started in
the background by one `run` must keep running, with its state, while later `run`s execute, until
the sandbox is paused, restored or closed. So the namespaces must outlive any one command: this
process is started by `unshare --pid --mount --net ...` as pid 1 of a fresh pid namespace, holds
the namespaces, and forks every command inside them on request from the host over a socket. When
it exits, the kernel kills every process left in its pid namespace; that is how `close()` (or the
host dying, which closes the socket) ends everything the sandbox started.

It runs as `python -I -S init_process.py FD CONFIG_JSON`: isolated mode, standard library only,
no imports from this package (the host imports `send_message`/`recv_message` from here, so the
wire format has one definition).

Wire format: each message is a 4-byte big-endian length and a UTF-8 JSON object. Requests carry
an "op"; binary data (stdin, stdout, stderr) travels base64-encoded.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import fcntl
import json
import os
import platform
import resource
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Any

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
ADDR_NO_RANDOMIZE = 0x0040000  # personality(2) flag: the same address-space layout in every run
PERSONALITY_QUERY = 0xFFFFFFFF  # personality(2) argument that changes nothing and returns the current one
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1

# /etc entries programs commonly need (dynamic linker cache, certificates, alternatives symlinks,
# Debian's python3 sitecustomize). The rest of the host's /etc stays invisible.
ETC_ENTRIES = (
    "alternatives",
    "ca-certificates",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "mime.types",
    "nsswitch.conf",
    "protocols",
    "python3",
    "python3.11",
    "python3.12",
    "services",
    "ssl",
)
DEVICES = ("null", "zero", "full", "random", "urandom")
READ_CHUNK = 65536
FINAL_READS = 64

_libc = ctypes.CDLL(None, use_errno=True)


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_message(sock: socket.socket) -> dict[str, Any] | None:
    """One message, or None when the peer closed the socket."""
    header = _recv_exact(sock, 4)
    if header is None:
        return None
    body = _recv_exact(sock, struct.unpack(">I", header)[0])
    if body is None:
        return None
    return json.loads(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def _bind(source: str, target: str, read_only: bool) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    # A bind mount takes the flags only on a remount; without this step it would stay writable.
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
    _mount("none", target, None, flags)


def _mountpoint(path: str, like: str) -> None:
    """Create an empty directory or file at `path` to mount `like` (a host path) on."""
    if os.path.isdir(like):
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()


def build_root(config: dict[str, Any]) -> None:
    """Mount the sandbox's view under config["root"] and pivot into it.

    /usr (and the /bin, /lib symlinks or directories), a few /etc entries and config["mounts"] are
    read-only binds of host paths; /workspace (config["workspace_mb"]), /tmp and /dev/shm are
    private size-capped tmpfs; /proc belongs to the new pid namespace; everything else of the
    host is absent. The root itself ends read-only.
    """
    root = config["root"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=8m")
    for name in ("bin", "lib", "lib32", "lib64", "libx32", "sbin", "usr"):
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}/{name}")
        elif os.path.isdir(host):
            os.mkdir(f"{root}/{name}")
            _bind(host, f"{root}/{name}", read_only=True)
    os.mkdir(f"{root}/etc")
    for name in ETC_ENTRIES:
        if os.path.exists(f"/etc/{name}"):
            _mountpoint(f"{root}/etc/{name}", f"/etc/{name}")
            _bind(f"/etc/{name}", f"{root}/etc/{name}", read_only=True)
    uid = config["uid"]
    files = {
        "passwd": f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{uid}:{uid}:sandbox:/workspace:/bin/sh\n",
        "group": f"root:x:0:\nsandbox:x:{uid}:\n",
        "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
        "hostname": "sandbox\n",
    }
    for name, text in files.items():
        with open(f"{root}/etc/{name}", "w") as f:
            f.write(text)
    if config["network"] and os.path.exists("/etc/resolv.conf"):
        _mountpoint(f"{root}/etc/resolv.conf", "/etc/resolv.conf")
        _bind("/etc/resolv.conf", f"{root}/etc/resolv.conf", read_only=True)
    for host, target in config["mounts"]:
        _mountpoint(root + target, host)
        _bind(host, root + target, read_only=True)
    os.mkdir(f"{root}/workspace")
    # A size-capped tmpfs: the limit holds for all files together (RLIMIT_FSIZE bounds only one),
    # and nothing lands on the host's disk.
    _mount(
        "tmpfs",
        f"{root}/workspace",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"mode=0755,uid={uid},gid={uid},size={config['workspace_mb']}m",
    )
    os.mkdir(f"{root}/tmp")
    _mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={config['tmp_mb']}m")
    os.mkdir(f"{root}/dev")
    _mount("tmpfs", f"{root}/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "a").close()
        # Plain bind, no read-only remount: writing to /dev/null must keep working.
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{root}/dev/{name}")
    os.mkdir(f"{root}/dev/shm")
    _mount("tmpfs", f"{root}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=16m")
    os.mkdir(f"{root}/proc")
    _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(f"{root}/.old_root")
    _check(
        _libc.syscall(SYS_PIVOT_ROOT[platform.machine()], root.encode(), f"{root}/.old_root".encode()),
        "pivot_root",
    )
    os.chdir("/")
    _check(_libc.umount2(b"/.old_root", MNT_DETACH), "umount old root")
    os.rmdir("/.old_root")
    _mount("none", "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def loopback_up() -> None:
    """A fresh network namespace has `lo` down; servers an agent starts inside expect 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(
            "16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14s", b"lo", 0, b""))[:18]
        )[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


class Capture:
    """Keeps the head and the tail of a stream within `limit` bytes and counts what is dropped."""

    def __init__(self, limit: int) -> None:
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > self.tail_limit:
            excess = len(self.tail) - self.tail_limit
            self.dropped += excess
            del self.tail[:excess]

    def value(self) -> bytes:
        marker = f"\n[... {self.dropped} bytes omitted ...]\n".encode() if self.dropped else b""
        return bytes(self.head) + marker + bytes(self.tail)


class Run:
    """One command: its process group, pipes, captured output and deadline."""

    def __init__(self, request: dict[str, Any], pid: int, pipes: dict[int, str], stdin: bytes) -> None:
        self.pid = pid
        self.pipes = pipes  # fd -> "stdout" | "stderr" | "stdin"
        self.stdin = memoryview(stdin)
        self.captures = {"stdout": Capture(request["max_output"]), "stderr": Capture(request["max_output"])}
        self.start = time.monotonic()
        self.deadline = self.start + request["timeout"]
        self.status: int | None = None
        self.cpu_seconds = 0.0
        self.timed_out = False


class Init:
    """The request loop: run commands, signal or kill every process, reap orphans."""

    def __init__(self, control: socket.socket, config: dict[str, Any], cgroup_fd: int | None) -> None:
        self.control = control
        self.config = config
        self.cgroup_fd = cgroup_fd
        self.selector = selectors.DefaultSelector()
        self.run: Run | None = None
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_r = wake_r
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(control, selectors.EVENT_READ, "control")
        self.selector.register(wake_r, selectors.EVENT_READ, "wake")

    def serve(self) -> None:
        while True:
            timeout = None
            if self.run is not None and self.run.status is None:
                timeout = max(0.0, self.run.deadline - time.monotonic())
            for key, _ in self.selector.select(timeout):
                if key.data == "control":
                    request = recv_message(self.control)
                    if request is None:  # the host closed the sandbox, or died
                        self.kill_all()
                        return
                    self.handle(request)
                elif key.data == "wake":
                    while _read_nonblocking(self.wake_r):
                        pass
                else:
                    self.pump(key.fd, key.data)
            self.reap()
            run = self.run
            if run is not None and run.status is None and time.monotonic() >= run.deadline:
                run.timed_out = True
                _kill_group(run.pid)
            if run is not None and run.status is not None:
                self.finish(run)

    def handle(self, request: dict[str, Any]) -> None:
        op = request["op"]
        if op == "run":
            self.start(request)
        elif op == "stop":
            send_message(self.control, {"ok": True, "running": self.stop_all()})
        elif op == "continue":
            _signal_all(signal.SIGCONT)
            send_message(self.control, {"ok": True})
        elif op == "kill":
            self.kill_all()
            send_message(self.control, {"ok": True})
        else:
            send_message(self.control, {"error": f"unknown op {op!r}"})

    def start(self, request: dict[str, Any]) -> None:
        if _task_count() >= self.config["rlimits"]["RLIMIT_NPROC"][0]:
            # The kernel checks RLIMIT_NPROC at setuid before counting the caller, so a command
            # started from here would be one task over the limit; refuse it here instead.
            message = f"sandbox: cannot start {request['argv'][0]!r}: {self.process_limit_reached()}\n"
            send_message(self.control, _run_reply(126, stderr=message.encode()))
            return
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stdin = base64.b64decode(request["stdin"]) if request.get("stdin") is not None else b""
        in_r, in_w = os.pipe() if request.get("stdin") is not None else (None, None)
        pid = os.fork()
        if pid == 0:
            self.exec_child(request, in_r, out_w, err_w)
        for fd in (out_w, err_w, in_r):
            if fd is not None:
                os.close(fd)
        pipes = {out_r: "stdout", err_r: "stderr"}
        if in_w is not None:
            pipes[in_w] = "stdin"
        self.run = Run(request, pid, pipes, stdin)
        for fd, name in pipes.items():
            os.set_blocking(fd, False)
            event = selectors.EVENT_WRITE if name == "stdin" else selectors.EVENT_READ
            self.selector.register(fd, event, name)

    def exec_child(self, request: dict[str, Any], stdin: int | None, stdout: int, stderr: int) -> None:
        """In the forked child: join the cgroup, apply limits, drop to the sandbox user, exec."""
        try:
            os.setsid()
            for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            if self.cgroup_fd is not None:
                os.write(self.cgroup_fd, b"0")
            for name, value in self.config["rlimits"].items():
                resource.setrlimit(getattr(resource, name), tuple(value))
            uid = self.config["uid"]
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
            # Addresses a program prints (object reprs, id()) are tool output the model reads: with
            # ASLR the same episode would get other tokens in every run (the sandbox's isolation is
            # its namespaces and limits, not address randomisation).
            if _libc.personality(_libc.personality(PERSONALITY_QUERY) | ADDR_NO_RANDOMIZE) == -1:
                raise OSError(ctypes.get_errno(), "personality(ADDR_NO_RANDOMIZE)")
            os.dup2(stdin if stdin is not None else os.open("/dev/null", os.O_RDONLY), 0)
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            os.closerange(3, 1 << 16)
            os.chdir(request["cwd"])
            argv, env = request["argv"], request["env"]
            if "/" not in argv[0]:
                found = _which(argv[0], env.get("PATH", ""))
                if found is None:
                    os.write(2, f"{argv[0]}: command not found\n".encode())
                    os._exit(127)
                argv = [found, *argv[1:]]
            os.execve(argv[0], argv, env)
        except BaseException as exc:  # noqa: BLE001 - the child must never return into the loop
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            reason = str(exc)
            if isinstance(exc, BlockingIOError):  # EAGAIN from setresuid/execve: RLIMIT_NPROC
                reason = (
                    f"the sandbox's process limit ({self.config['rlimits']['RLIMIT_NPROC'][0]}) is reached"
                )
            try:
                os.write(2, f"sandbox: cannot start {request['argv'][0]!r}: {reason}\n".encode())
            finally:
                os._exit(code)

    def process_limit_reached(self) -> str:
        return f"the sandbox's process limit ({self.config['rlimits']['RLIMIT_NPROC'][0]}) is reached"

    def pump(self, fd: int, name: str) -> None:
        run = self.run
        if run is None or fd not in run.pipes:
            self._drain_detached(fd)
            return
        if name == "stdin":
            try:
                written = os.write(fd, run.stdin[:READ_CHUNK])
                run.stdin = run.stdin[written:]
                done = not run.stdin
            except BlockingIOError:
                done = False
            except OSError:  # the command closed its stdin
                done = True
            if done:
                self._close(fd)
                del run.pipes[fd]
            return
        data = _read_nonblocking(fd)
        if data:
            run.captures[name].add(data)
        elif data == b"":
            self._close(fd)
            del run.pipes[fd]

    def _drain_detached(self, fd: int) -> None:
        """Output a background process writes after its run returned is discarded, never blocking it."""
        if _read_nonblocking(fd) == b"":
            self._close(fd)

    def _close(self, fd: int) -> None:
        self.selector.unregister(fd)
        os.close(fd)

    def reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.run is not None and pid == self.run.pid:
                self.run.status = status
                self.run.cpu_seconds = usage.ru_utime + usage.ru_stime

    def finish(self, run: Run) -> None:
        for fd, name in list(run.pipes.items()):
            if name == "stdin":
                self._close(fd)
                continue
            # What the command wrote is in the pipe already; the bound stops a background process
            # that keeps writing from holding this loop.
            for _ in range(FINAL_READS):
                data = _read_nonblocking(fd)
                if not data:
                    break
                run.captures[name].add(data)
            if data == b"":
                self._close(fd)
            else:
                # A background process still holds the pipe: keep draining it, detached from this run.
                self.selector.modify(fd, selectors.EVENT_READ, "detached")
        status = run.status
        assert status is not None
        exit_code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self.run = None
        send_message(
            self.control,
            _run_reply(
                exit_code,
                timed_out=run.timed_out,
                cpu_seconds=run.cpu_seconds,
                wall_seconds=time.monotonic() - run.start,
                stdout=run.captures["stdout"].value(),
                stderr=run.captures["stderr"].value(),
            ),
        )

    def stop_all(self) -> int:
        """SIGSTOP every process and wait until each one is really stopped (or 2 s passed).

        Returns how many processes were still running at the end (0 on success). The signal is
        resent while waiting because a process forked just before it arrived may have missed it.
        """
        deadline = time.monotonic() + 2.0
        while True:
            _signal_all(signal.SIGSTOP)
            running = _running_processes()
            if not running or time.monotonic() >= deadline:
                return len(running)
            time.sleep(0.0005)

    def kill_all(self) -> None:
        while _signal_all(signal.SIGKILL):
            self.reap()
            time.sleep(0.0005)
        self.reap()


def _run_reply(
    exit_code: int,
    *,
    timed_out: bool = False,
    cpu_seconds: float = 0.0,
    wall_seconds: float = 0.0,
    stdout: bytes = b"",
    stderr: bytes = b"",
) -> dict[str, Any]:
    return {
        "exit_code": exit_code,
        "timed_out": timed_out,
        "cpu_seconds": cpu_seconds,
        "wall_seconds": wall_seconds,
        "stdout": base64.b64encode(stdout).decode(),
        "stderr": base64.b64encode(stderr).decode(),
    }


def _signal_all(sig: int) -> bool:
    """Send `sig` to every process of this pid namespace but init; False when there were none."""
    try:
        os.kill(-1, sig)
        return True
    except ProcessLookupError:
        return False


def _task_count() -> int:
    """Tasks (threads) of every process in this pid namespace but init: what RLIMIT_NPROC counts."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit() and name != "1":
            try:
                count += len(os.listdir(f"/proc/{name}/task"))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return count


def _running_processes() -> list[int]:
    running = []
    for name in os.listdir("/proc"):
        if name.isdigit() and name != "1":
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if state not in (b"T", b"t", b"Z", b"X"):
                running.append(int(name))
    return running


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read_nonblocking(fd: int) -> bytes | None:
    """Available bytes, b"" at end of file, None when nothing is available now."""
    try:
        return os.read(fd, READ_CHUNK)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno == errno.EIO:
            return b""
        raise


def _which(name: str, path: str) -> str | None:
    for directory in path.split(":"):
        candidate = os.path.join(directory or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def hide_command_line() -> None:
    """Overwrite this process's argv in place: /proc/1/cmdline is readable by every sandboxed
    process, and the argv holds the host's interpreter and file paths, the uid, the rlimits and
    the cgroup path. The kernel reads cmdline from the [arg_start, arg_end) range of the process's
    memory, which /proc/self/stat names (fields 48 and 49)."""
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # fields 48, 49 counted from 1 with pid, comm
    title = b"sandbox-init"
    with open("/proc/self/mem", "r+b", buffering=0) as memory:
        memory.seek(start)
        memory.write(title.ljust(end - start, b"\0")[: end - start])


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    os.set_inheritable(control.fileno(), False)
    config = json.loads(sys.argv[2])
    hide_command_line()
    # The host's /proc is still mounted here: its `self` names this process by its host pid,
    # which the host needs to reach /workspace through /proc/<pid>/root.
    host_pid = int(os.readlink("/proc/self"))
    try:
        cgroup_fd = None
        if config["cgroup_procs"]:
            cgroup_fd = os.open(config["cgroup_procs"], os.O_WRONLY | os.O_CLOEXEC)
        build_root(config)
        if not config["network"]:
            loopback_up()
        socket.sethostname("sandbox")
    except Exception as exc:  # noqa: BLE001 - reported to the host, which raises it
        send_message(control, {"error": f"sandbox setup failed: {exc!r}"})
        sys.exit(1)
    send_message(control, {"ok": True, "pid": host_pid})
    Init(control, config, cgroup_fd).serve()


if __name__ == "__main__":
    main()
