"""The workspace has a size limit for all its files together (not only per file), nothing an agent
writes lands on the host's disk, and /proc/1/cmdline tells a sandboxed process nothing of the host."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from posttrain.envs.sandbox import Sandbox


def host_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def test_the_workspace_limit_holds_for_the_total(tmp_path: Path) -> None:
    with Sandbox(
        memory_mb=256, max_file_mb=32, workspace_mb=64, base_dir=tmp_path, snapshot_root=tmp_path / "snaps"
    ) as sb:
        result = sb.run(
            "for i in 1 2 3 4; do "
            "dd if=/dev/zero of=/workspace/f$i bs=1M count=24 2>&1 || echo FULL $i; done; du -sm /workspace",
            timeout=60,
        )
        assert "No space left on device" in result.stdout and "FULL 3" in result.stdout, result.stdout
        used = int(result.stdout.strip().splitlines()[-1].split()[0])
        assert 48 <= used <= 64
        assert sum(f.stat().st_size for f in sb.workspace.iterdir()) <= 64 << 20
        assert host_bytes(tmp_path) < 1 << 20  # the host's temp dir holds none of it
        assert sb.run("echo ok > /workspace/small 2>&1; rm /workspace/f1; echo ok > /workspace/small").ok


def test_proc_1_cmdline_shows_no_host_details(sandbox: Sandbox) -> None:
    cmdline = sandbox.run("cat /proc/1/cmdline").stdout
    assert cmdline.strip("\0") == "sandbox-init"
    for secret in (sys.executable, str(sandbox.uid), "RLIMIT", "cgroup", os.path.dirname(__file__)):
        assert secret not in cmdline
