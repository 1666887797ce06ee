"""How fast are the sandbox operations an RL rollout loop leans on? Times create, run, snapshot
(full and incremental), restore (incremental and into a fresh sandbox), fork, pause and resume,
and prints median and p95 next to K3's reported microVM numbers (133 ms checkpoint, 49 ms resume).

The comparison is loose: a K3 checkpoint holds a microVM's memory and disk (dirty pages), ours holds
the workspace's files only (processes are not snapshotted), so the closest pairs are
checkpoint ~ snapshot and resume ~ restore (resume of a paused sandbox is also shown).

Usage (as root): python bench/sandbox.py [--repeats 20] [--files 200] [--file-kb 4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from posttrain.envs.sandbox import Sandbox

K3_REFERENCE_MS = {"snapshot (incremental)": 133.0, "restore (latest, 1 file changed)": 49.0, "resume": 49.0}


class Stopwatch:
    """`with watch("name"): ...` appends the block's wall time in ms to `watch.times["name"]`."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.times.setdefault(name, []).append((time.perf_counter() - start) * 1000)


def summarise(samples: list[float]) -> tuple[float, float]:
    """Median and 95th percentile, in the samples' unit."""
    p95 = statistics.quantiles(samples, n=20, method="inclusive")[-1] if len(samples) > 1 else samples[0]
    return statistics.median(samples), p95


def populate(sb: Sandbox, files: int, file_kb: int) -> None:
    write = f"open(f'f{{i:04d}}', 'wb').write(os.urandom({file_kb << 10}))"
    result = sb.run(["python3", "-c", f"import os\nfor i in range({files}): {write}"])
    assert result.exit_code == 0, result


def measure(repeats: int, files: int, file_kb: int, snapshot_root: Path) -> dict[str, list[float]]:
    watch = Stopwatch()
    for _ in range(repeats):
        with watch("create"):
            sb = Sandbox(snapshot_root=snapshot_root)
        with watch("run (true)"):
            sb.run("true")
        populate(sb, files, file_kb)
        sb.run("sleep 600 &")  # a background process for pause/resume to stop and continue
        with watch("snapshot (full)"):
            sb.snapshot()
        sb.run("echo changed > f0000")
        with watch("snapshot (incremental)"):
            latest = sb.snapshot()
        sb.run("echo again > f0001")
        with watch("restore (latest, 1 file changed)"):
            sb.restore(latest)
        sb.run("sleep 600 &")
        with watch("pause"):
            sb.pause()
        with watch("resume"):
            sb.resume()
        with watch("fork"):
            child = sb.fork()
        child.close()
        with watch("from_snapshot (new sandbox)"):
            fresh = Sandbox.from_snapshot(latest)
        fresh.close()
        with watch("close"):
            sb.close()
    return watch.times


def machine() -> str:
    model = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{model}, {os.cpu_count()} cores, Linux {platform.release()}, load average {load}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--files", type=int, default=200, help="workspace files written before snapshotting")
    parser.add_argument("--file-kb", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sandbox-bench-") as root:
        with Sandbox(snapshot_root=root) as probe:
            enforcement = probe.memory_enforcement
        times = measure(args.repeats, args.files, args.file_kb, Path(root))
    print(f"machine: {machine()}; memory limit via {enforcement}")
    print(f"workspace: {args.files} files x {args.file_kb} KiB; {args.repeats} repeats; times in ms")
    print(f"{'operation':36s} {'median':>8s} {'p95':>8s}   K3 (Firecracker, reported)")
    for name, samples in times.items():
        median, p95 = summarise(samples)
        reference = K3_REFERENCE_MS.get(name)
        note = f"{reference:.0f} ms" if reference is not None else ""
        print(f"{name:36s} {median:8.1f} {p95:8.1f}   {note}")


if __name__ == "__main__":
    main()
