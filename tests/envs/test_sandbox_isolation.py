"""Escape attempts from inside a sandbox, each of which must fail and leave the host untouched, and
bad inputs, each of which must give a clear result without hanging (issue 7 acceptance)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from sandbox_helpers import host_pids_of, wait_for_file

from posttrain.envs.sandbox import Sandbox, SandboxError


def test_writes_outside_the_workspace_fail_and_the_host_is_untouched(sandbox: Sandbox, tmp_path: Path):
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    host_dir.chmod(0o777)  # the host would let anyone write here: only the sandbox's view stops it
    targets = [
        host_dir / "escape.txt",
        Path("/usr/escape.txt"),
        Path("/etc/escape.txt"),
        Path("/escape.txt"),
        sandbox.workspace.parent / "escape.txt",
    ]
    for target in targets:
        result = sandbox.run(f"echo pwned > {target}")
        assert result.exit_code != 0, target
        assert not target.exists(), target
    result = sandbox.run("echo pwned > /workspace/../escape.txt")
    assert result.exit_code != 0
    assert not (sandbox.workspace.parent / "escape.txt").exists()
    # The same command does write where it may: the failures above are isolation, not a broken shell.
    assert sandbox.run("echo kept > /workspace/inside.txt").exit_code == 0
    assert (sandbox.workspace / "inside.txt").read_text() == "kept\n"


def test_a_host_secret_file_cannot_be_read(sandbox: Sandbox, tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2-7f3a")
    secret.chmod(0o644)  # world-readable on the host
    for path in (str(secret), f"/proc/1/root{secret}", f"/proc/1/cwd/..{secret}"):
        result = sandbox.run(["cat", path])
        assert result.exit_code != 0, path
        assert "hunter2" not in result.stdout + result.stderr
    found = sandbox.run("grep -rs hunter2 /etc /workspace /tmp /proc/1/root 2>/dev/null")
    assert "hunter2" not in found.stdout


def test_host_side_reading_of_workspace_files_never_follows_planted_symlinks(
    sandbox: Sandbox, tmp_path: Path
):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2-7f3a")
    sandbox.run(f"ln -s {secret} leak && ln -s /etc/hostname leak2 && mkdir d && printf 'a\\377' > d/f")
    assert sandbox.workspace_files() == {"d/f": b"a\xff"}
    assert sandbox.workspace_files(max_bytes=1) == {"d/f": b"a"}


CONNECT = """
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2).sendall(b"hello")
    print("connected")
except OSError as exc:
    print("refused", exc)
"""


def test_a_tcp_listener_on_host_loopback_is_unreachable(tmp_path: Path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        with Sandbox(snapshot_root=tmp_path) as sb:
            result = sb.run(["python3", "-c", CONNECT, str(port)])
        assert result.stdout.startswith("refused"), result
        with pytest.raises(TimeoutError):
            listener.accept()
        # Control: with network=True the same program reaches the listener, so the test can see one.
        with Sandbox(network=True, snapshot_root=tmp_path) as sb:
            result = sb.run(["python3", "-c", CONNECT, str(port)])
        assert result.stdout.startswith("connected"), result
        connection, _ = listener.accept()
        connection.close()


def test_allocating_past_the_memory_limit_is_killed_and_reported(tmp_path: Path):
    with Sandbox(memory_mb=64, snapshot_root=tmp_path) as sb:
        assert sb.memory_enforcement.startswith("cgroup")
        result = sb.run(["python3", "-c", "b = bytearray(256 << 20); print('allocated')"])
        assert result.killed_reason == "memory"
        assert result.exit_code == -9
        assert "allocated" not in result.stdout
        within = sb.run(["python3", "-c", "b = bytearray(8 << 20); print(len(b))"])
        assert within.stdout == f"{8 << 20}\n" and within.killed_reason is None


def test_an_infinite_loop_is_timed_out_within_the_timeout_plus_two_seconds(sandbox: Sandbox):
    start = time.monotonic()
    result = sandbox.run("while :; do :; done", timeout=1)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.killed_reason == "timeout"
    assert elapsed < 1 + 2
    assert host_pids_of(sandbox.uid) == []  # the loop's whole process group is gone
    assert sandbox.run("echo next").stdout == "next\n"


def test_cpu_time_past_the_limit_is_killed_and_reported(tmp_path: Path):
    with Sandbox(cpu_seconds=1, snapshot_root=tmp_path) as sb:
        result = sb.run(["python3", "-c", "while True: pass"], timeout=30)
    assert result.killed_reason == "cpu" and not result.timed_out
    assert result.exit_code == -24  # SIGXCPU


def test_a_file_past_the_size_limit_is_cut_and_reported(tmp_path: Path):
    with Sandbox(max_file_mb=1, snapshot_root=tmp_path) as sb:
        result = sb.run("head -c 3145728 /dev/zero > big")
        assert result.killed_reason == "file_size" and result.exit_code == 128 + 25  # SIGXFSZ via sh
        assert (sb.workspace / "big").stat().st_size == 1 << 20
        sparse = sb.run(["truncate", "-s", "1T", "sparse"])
        assert sparse.killed_reason == "file_size" and sparse.exit_code == -25
        assert (sb.workspace / "sparse").stat().st_size == 0
        python = sb.run(["python3", "-c", "open('py', 'wb').write(bytes(3 << 20))"])  # Python ignores SIGXFSZ
        assert python.exit_code == 1 and "File too large" in python.stderr


FORK_MANY = """
import os, time
children = refusals = 0
while refusals < 5:  # retry a little: the shell that started us may still hold a process slot
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
    except BlockingIOError:
        refusals += 1
        time.sleep(0.1)
print("refused after", children, flush=True)
time.sleep(60)
"""


def test_spawning_past_the_process_limit_is_refused(tmp_path: Path):
    with Sandbox(max_processes=8, snapshot_root=tmp_path) as sb:
        (sb.workspace / "fork_many.py").write_text(FORK_MANY)
        sb.run("python3 fork_many.py > out.txt 2>&1 &")
        out = wait_for_file(sb.workspace / "out.txt", lambda text: "refused" in text)
        assert out == "refused after 7\n"  # 7 children + the parent
        assert len(host_pids_of(sb.uid)) == 8
        blocked = sb.run("echo more")
        assert blocked.exit_code == 126 and "process limit (8) is reached" in blocked.stderr
        uid = sb.uid
    assert host_pids_of(uid) == []


def test_close_ends_background_processes_and_removes_the_workspace(tmp_path: Path):
    sb = Sandbox(snapshot_root=tmp_path)
    sb.run("sleep 300 & sleep 300 &")
    assert len(host_pids_of(sb.uid)) == 2
    workspace = sb.workspace
    sb.close()
    assert host_pids_of(sb.uid) == []
    assert not workspace.exists()
    with pytest.raises(SandboxError, match="closed"):
        sb.run("true")
    sb.close()  # idempotent


def test_closing_in_a_forked_host_process_leaves_the_owners_sandbox_running(sandbox: Sandbox):
    sandbox.run("echo mine > owned.txt")
    pid = os.fork()
    if pid == 0:  # a multiprocessing-style worker that inherited the Sandbox object
        sandbox.close()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert sandbox.run("cat owned.txt").stdout == "mine\n"


def test_a_missing_command_exits_127_with_a_message(sandbox: Sandbox):
    shell = sandbox.run("no_such_command_xyz --flag")
    assert shell.exit_code == 127 and "no_such_command_xyz: not found" in shell.stderr
    argv = sandbox.run(["no_such_command_xyz"])
    assert argv.exit_code == 127 and argv.stderr == "no_such_command_xyz: command not found\n"
    path = sandbox.run(["/workspace/missing.sh"])
    assert path.exit_code == 127 and "missing.sh" in path.stderr


def test_non_utf8_output_is_decoded_with_replacement(sandbox: Sandbox):
    result = sandbox.run(["python3", "-c", r"import sys; sys.stdout.buffer.write(b'ok \xff\xfe end')"])
    assert result.stdout == "ok \ufffd\ufffd end"


def test_timeout_zero_or_negative_is_a_value_error_and_the_sandbox_still_works(sandbox: Sandbox):
    for bad in (0, -1, 0.0):
        with pytest.raises(ValueError, match="timeout must be > 0"):
            sandbox.run("sleep 10", timeout=bad)
    short = sandbox.run("sleep 10", timeout=0.05)
    assert short.timed_out
    assert sandbox.run("echo fine").stdout == "fine\n"


def test_other_bad_inputs_are_clear_errors(sandbox: Sandbox, tmp_path: Path):
    with pytest.raises(ValueError, match="empty list"):
        sandbox.run([])
    with pytest.raises(FileNotFoundError, match="not a sandbox snapshot"):
        sandbox.restore(tmp_path)
    with pytest.raises(ValueError, match="memory_mb"):
        Sandbox(memory_mb=0)
    with pytest.raises(ValueError, match="inside /workspace"):
        Sandbox(mounts={str(tmp_path): "/workspace/docs"})
    with pytest.raises(ValueError, match="does not exist"):
        Sandbox(mounts={str(tmp_path / "nope"): "/opt/nope"})
    sandbox.pause()
    with pytest.raises(SandboxError, match="paused"):
        sandbox.run("true")


def test_long_output_keeps_head_and_tail_and_stdin_reaches_the_command(tmp_path: Path):
    with Sandbox(max_output_bytes=1000, snapshot_root=tmp_path) as sb:
        result = sb.run(["python3", "-c", "print('A' * 5000 + 'Z' * 5000)"])
        assert result.stdout.startswith("A" * 500) and result.stdout.endswith("Z" * 499 + "\n")
        assert "[... 9001 bytes omitted ...]" in result.stdout
        echoed = sb.run(["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin="héllo")
        assert echoed.stdout == "olléh\n"


def test_read_only_mounts_are_visible_but_not_writable(tmp_path: Path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("shipped")
    with Sandbox(mounts={str(docs): "/opt/docs"}, snapshot_root=tmp_path) as sb:
        assert sb.run("cat /opt/docs/a.txt").stdout == "shipped"
        assert sb.run("echo x > /opt/docs/a.txt").exit_code != 0
    assert (docs / "a.txt").read_text() == "shipped"
