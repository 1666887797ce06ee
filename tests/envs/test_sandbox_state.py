"""Sandbox state semantics: background processes persist and pause, fork is isolated both ways,
snapshots restore exactly, survive their creator, and copy only what changed (issue 7 acceptance)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sandbox_helpers import host_pids_of, host_state, wait_for_file

from posttrain.envs.sandbox import Sandbox

COUNTER = """
import os, time
i = 0
while True:
    i += 1
    with open("count.tmp", "w") as f:
        f.write(str(i))
    os.replace("count.tmp", "count")
    time.sleep(0.01)
"""


def _count(sb: Sandbox) -> int:
    return int((sb.workspace / "count").read_text())


def test_background_process_persists_pauses_and_resumes_with_its_state(sandbox: Sandbox):
    (sandbox.workspace / "counter.py").write_text(COUNTER)
    sandbox.run("python3 counter.py > /dev/null 2>&1 &")
    wait_for_file(sandbox.workspace / "count", lambda text: text.isdigit() and int(text) >= 5)
    assert sandbox.run("echo other run").exit_code == 0  # later runs leave it running
    before_pause = _count(sandbox)
    wait_for_file(sandbox.workspace / "count", lambda text: text.isdigit() and int(text) > before_pause)

    sandbox.pause()
    frozen = _count(sandbox)
    pids = host_pids_of(sandbox.uid)
    assert len(pids) == 1 and host_state(pids[0]) == "T"
    time.sleep(0.3)  # thirty ticks of the counter if it were running
    assert _count(sandbox) == frozen

    sandbox.resume()
    resumed = wait_for_file(sandbox.workspace / "count", lambda text: text.isdigit() and int(text) > frozen)
    assert int(resumed) > frozen  # it continued from its own state, not from 1
    assert host_pids_of(sandbox.uid) == pids


def test_fork_copies_files_not_processes_and_is_isolated_both_ways(sandbox: Sandbox):
    sandbox.run("mkdir -p notes && echo parent > notes/a.txt; sleep 300 &")
    child = sandbox.fork()
    try:
        assert child.uid != sandbox.uid
        assert child.run("cat notes/a.txt").stdout == "parent\n"
        assert host_pids_of(child.uid) == []  # the parent's sleep was not forked
        assert len(host_pids_of(sandbox.uid)) == 1

        child.run("echo child > notes/a.txt && echo only-child > b.txt")
        sandbox.run("echo only-parent > c.txt")
        assert sandbox.run("cat notes/a.txt").stdout == "parent\n"
        assert sandbox.run("cat b.txt").exit_code != 0
        assert child.run("cat c.txt").exit_code != 0
        assert (child.workspace / "notes" / "a.txt").read_text() == "child\n"
        assert child.config == sandbox.config
    finally:
        child.close()
    assert sandbox.run("cat notes/a.txt").stdout == "parent\n"  # closing the fork left the parent alone


SETUP = (
    "mkdir -p src/pkg && echo v1 > src/pkg/mod.py && echo keep > keep.txt && echo gone > gone.txt "
    "&& chmod 755 keep.txt && ln -s src/pkg/mod.py link && printf '\\377bin' > blob "
    # Old times, so a restore that did not put them back could not pass by landing in the same second.
    "&& touch -d @1000000000 gone.txt src/pkg && touch -h -d @1000000000 link"
)


def test_snapshot_change_restore_gives_the_snapshots_files(sandbox: Sandbox):
    sandbox.run(SETUP)
    expected = sandbox.run("ls -lR --time-style=+%s . && md5sum blob keep.txt src/pkg/mod.py").stdout
    snapshot = sandbox.snapshot()

    sandbox.run(
        "echo v2 > src/pkg/mod.py && rm gone.txt && echo new > new.txt && chmod 600 keep.txt "
        "&& rm link && ln -s keep.txt link && rm -r src/pkg && echo file > src/pkg; sleep 300 &"
    )
    assert len(host_pids_of(sandbox.uid)) == 1
    sandbox.restore(snapshot)

    assert sandbox.run("ls -lR --time-style=+%s . && md5sum blob keep.txt src/pkg/mod.py").stdout == expected
    assert sandbox.run("cat src/pkg/mod.py gone.txt").stdout == "v1\ngone\n"
    assert not (sandbox.workspace / "new.txt").exists()
    assert os.readlink(sandbox.workspace / "link") == "src/pkg/mod.py"
    assert host_pids_of(sandbox.uid) == []  # restore ends the processes: they are not in a snapshot
    assert sandbox.run("echo again >> keep.txt").exit_code == 0  # files belong to the sandbox user


def test_restoring_the_latest_snapshot_rewrites_only_the_changed_files(sandbox: Sandbox):
    sandbox.run("for i in 1 2 3 4 5; do echo $i > f$i; done")
    snapshot = sandbox.snapshot()
    inodes = {name: os.stat(sandbox.workspace / name).st_ino for name in ("f1", "f2", "f3")}
    sandbox.run("echo changed > f2")
    sandbox.restore(snapshot)
    assert os.stat(sandbox.workspace / "f1").st_ino == inodes["f1"]
    assert os.stat(sandbox.workspace / "f3").st_ino == inodes["f3"]
    assert (sandbox.workspace / "f2").read_text() == "2\n"


def test_snapshots_are_incremental_on_disk(sandbox: Sandbox):
    sandbox.run(
        "echo a > unchanged.txt && echo b > modified.txt && echo c > deleted.txt && mkdir d "
        "&& echo e > d/nested.txt"
    )
    first = Path(sandbox.snapshot())
    sandbox.run("echo B > modified.txt && rm deleted.txt && echo n > added.txt")
    second = Path(sandbox.snapshot())

    stats = json.loads((second / "manifest.json").read_text())["stats"]
    assert stats == {"copied_files": 2, "linked_files": 2, "copied_bytes": 4}
    for name in ("unchanged.txt", "d/nested.txt"):
        assert os.stat(first / "files" / name).st_ino == os.stat(second / "files" / name).st_ino
    assert (
        os.stat(first / "files" / "modified.txt").st_ino != os.stat(second / "files" / "modified.txt").st_ino
    )
    assert (first / "files" / "modified.txt").read_text() == "b\n"
    assert (second / "files" / "modified.txt").read_text() == "B\n"
    assert not (second / "files" / "deleted.txt").exists()

    shutil.rmtree(first)  # each snapshot is complete on its own
    with Sandbox.from_snapshot(second) as restored:
        out = restored.run("cat unchanged.txt modified.txt added.txt d/nested.txt").stdout
    assert out == "a\nB\nn\ne\n"


CREATOR = """
import sys
from posttrain.envs.sandbox import Sandbox
sb = Sandbox(memory_mb=200, max_processes=20, env={"GREETING": "hi"}, snapshot_root=sys.argv[1])
sb.run("mkdir -p out && echo 'built by a dead process' > out/result.txt; sleep 300 &")
print(sb.snapshot())
"""


def test_a_snapshot_restores_in_a_new_sandbox_after_its_creator_process_died(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-c", CREATOR, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    )
    snapshot = done.stdout.strip()
    with Sandbox.from_snapshot(snapshot) as sb:
        assert sb.run("cat out/result.txt").stdout == "built by a dead process\n"
        assert sb.run("echo $GREETING").stdout == "hi\n"
        assert (sb.config["memory_mb"], sb.config["max_processes"]) == (200, 20)
        assert Path(sb.snapshot()).parent == tmp_path


def test_snapshot_of_a_closed_sandbox_restores_into_a_fresh_one(tmp_path: Path):
    with Sandbox(snapshot_root=tmp_path) as original:
        original.run("echo state > s.txt")
        snapshot = original.snapshot()
    with Sandbox(snapshot_root=tmp_path) as fresh:
        fresh.run("echo other > s.txt && echo extra > x.txt")
        fresh.restore(snapshot)
        assert fresh.run("cat s.txt; ls").stdout == "state\ns.txt\n"
