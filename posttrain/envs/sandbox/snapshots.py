"""Workspace snapshots as plain directories: incremental, self-contained, restorable by any process.

A snapshot is `<root>/<id>/` holding `files/` (the workspace tree) and `manifest.json` (every
entry's kind, mode, size, mtime and symlink target, the sandbox config, the parent snapshot and
copy statistics). Only files changed since the parent snapshot are copied; unchanged ones are hard
links to the parent's copies, so each snapshot is complete on its own (deleting an older one never
breaks a newer one) and costs disk only for what changed. Files are never hard-linked into a live
workspace: a write there would change the snapshot too.

"Unchanged" means the file's (inode, size, mtime, ctime) equals what was recorded when the parent
snapshot was taken or restored. ctime is set by the kernel on every change and cannot be forged by
the unprivileged sandbox user (unlike mtime). `settle_time_ns` covers file systems with coarse
timestamps: a change within the same clock tick as the recorded ctime would keep the ctime, so the
sandbox does not let its processes run again until that tick has passed.

Everything here runs as root on the host over a tree the sandbox user controls, so no path is
ever followed through a symlink: trees are walked with lstat semantics, files are opened with
O_NOFOLLOW, special files (fifos, sockets) are skipped, and the sandbox is paused meanwhile.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# Upper bound of a file-system timestamp tick (one jiffy at HZ=100).
TIMESTAMP_TICK_NS = 10_000_000

Signature = tuple[int, int, int, int]


@dataclass(frozen=True)
class Entry:
    kind: str  # "dir" | "file" | "symlink"
    mode: int
    size: int
    mtime_ns: int
    target: str | None
    signature: Signature
    ctime_ns: int


def scan(workspace: Path) -> dict[str, Entry]:
    """Every directory, regular file and symlink under `workspace`, keyed by relative path."""
    entries: dict[str, Entry] = {}
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        with os.scandir(workspace / rel_dir if rel_dir else workspace) as it:
            for item in it:
                rel = f"{rel_dir}/{item.name}" if rel_dir else item.name
                st = item.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    kind, target = "dir", None
                    pending.append(rel)
                elif stat.S_ISREG(st.st_mode):
                    kind, target = "file", None
                elif stat.S_ISLNK(st.st_mode):
                    kind, target = "symlink", os.readlink(item.path)
                else:
                    continue
                entries[rel] = Entry(
                    kind,
                    stat.S_IMODE(st.st_mode),
                    st.st_size,
                    st.st_mtime_ns,
                    target,
                    (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),
                    st.st_ctime_ns,
                )
    return entries


def signatures(entries: dict[str, Entry]) -> dict[str, Signature]:
    return {rel: e.signature for rel, e in entries.items() if e.kind == "file"}


def settle_time_ns(entries: dict[str, Entry]) -> int:
    """Wall-clock time (ns) after which a change to any scanned file gets a different ctime."""
    newest = max((e.ctime_ns for e in entries.values()), default=0)
    return newest + TIMESTAMP_TICK_NS


def write_snapshot(
    workspace: Path, dest: Path, parent: Path | None, baseline: dict[str, Signature], config: dict[str, Any]
) -> dict[str, Entry]:
    """Copy `workspace` into the new snapshot directory `dest`, linking files unchanged since
    `parent` (whose recorded signatures are `baseline`). Returns the scanned entries."""
    entries = scan(workspace)
    partial = dest.with_name(f".{dest.name}.partial")
    files = partial / "files"
    files.mkdir(parents=True)
    parent_files = parent / "files" if parent is not None else None
    copied = linked = copied_bytes = 0
    try:
        for rel in sorted(entries):
            entry, target = entries[rel], files / rel
            if entry.kind == "dir":
                target.mkdir(mode=0o700)
            elif entry.kind == "symlink":
                os.symlink(entry.target or "", target)
            elif (
                parent_files is not None
                and baseline.get(rel) == entry.signature
                and _link(parent_files / rel, target)
            ):
                linked += 1
            else:
                _copy_file(workspace / rel, target, mode=0o400)
                copied += 1
                copied_bytes += entry.size
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    manifest = {
        "format": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "parent": str(parent) if parent is not None else None,
        "config": config,
        "stats": {"copied_files": copied, "linked_files": linked, "copied_bytes": copied_bytes},
        "entries": {
            rel: {"kind": e.kind, "mode": e.mode, "size": e.size, "mtime_ns": e.mtime_ns, "target": e.target}
            for rel, e in entries.items()
        },
    }
    # No fsync: a snapshot must outlive the process that wrote it, which the page cache gives;
    # surviving a power loss would mean syncing every copied file. The rename publishes it whole.
    with open(partial / MANIFEST, "w") as f:
        json.dump(manifest, f)
    os.rename(partial, dest)
    return entries


def read_manifest(snapshot: Path) -> dict[str, Any]:
    path = snapshot / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{snapshot} is not a sandbox snapshot: {MANIFEST} is missing (pass the path snapshot() returned)"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: snapshot format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}"
        )
    return manifest


def restore_snapshot(
    snapshot: Path, workspace: Path, uid: int, keep: dict[str, Signature]
) -> dict[str, Entry]:
    """Make `workspace` equal to `snapshot`'s files, owned by `uid`.

    `keep` holds signatures recorded when this same snapshot was last taken or restored into this
    workspace: files still matching them are already right and are left alone, so restoring the
    latest snapshot after a few changes rewrites only those. Returns the entries afterwards.
    """
    wanted = read_manifest(snapshot)["entries"]
    source = snapshot / "files"
    for rel, entry in sorted(scan(workspace).items(), reverse=True):
        want = wanted.get(rel)
        if (
            want is not None
            and want["kind"] == entry.kind
            and (
                entry.kind == "dir"
                or (entry.kind == "file" and keep.get(rel) == entry.signature)
                or (entry.kind == "symlink" and want["target"] == entry.target)
            )
        ):
            continue
        _remove(workspace / rel)
    for rel in sorted(wanted):
        want, target = wanted[rel], workspace / rel
        if os.path.lexists(target):
            continue
        if want["kind"] == "dir":
            target.mkdir()
        elif want["kind"] == "symlink":
            os.symlink(want["target"], target)
            os.lchown(target, uid, uid)
            os.utime(target, ns=(want["mtime_ns"], want["mtime_ns"]), follow_symlinks=False)
        else:
            _copy_file(source / rel, target, mode=want["mode"], uid=uid, mtime_ns=want["mtime_ns"])
    for rel in sorted(wanted, reverse=True):  # directories last, deepest first, so mtimes stick
        want = wanted[rel]
        if want["kind"] == "dir":
            target = workspace / rel
            os.chown(target, uid, uid, follow_symlinks=False)
            os.chmod(target, want["mode"], follow_symlinks=False)
            os.utime(target, ns=(want["mtime_ns"], want["mtime_ns"]), follow_symlinks=False)
    return scan(workspace)


def copy_workspace(source: Path, dest: Path, uid: int) -> None:
    """Copy a live (paused) workspace into an empty one owned by `uid`: the files half of fork()."""
    entries = scan(source)
    for rel in sorted(entries):
        entry, target = entries[rel], dest / rel
        if entry.kind == "dir":
            target.mkdir()
        elif entry.kind == "symlink":
            os.symlink(entry.target or "", target)
            os.lchown(target, uid, uid)
            os.utime(target, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
        else:
            _copy_file(source / rel, target, mode=entry.mode, uid=uid, mtime_ns=entry.mtime_ns)
    for rel in sorted(entries, reverse=True):
        entry = entries[rel]
        if entry.kind == "dir":
            os.chown(dest / rel, uid, uid, follow_symlinks=False)
            os.chmod(dest / rel, entry.mode, follow_symlinks=False)
            os.utime(dest / rel, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)


def read_files(workspace: Path, max_bytes: int) -> dict[str, bytes]:
    """The regular files of a (paused) workspace, at most `max_bytes` each; symlinks are skipped."""
    files = {}
    for rel, entry in sorted(scan(workspace).items()):
        if entry.kind == "file":
            fd = os.open(workspace / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    files[rel] = os.pread(fd, max_bytes, 0)
            finally:
                os.close(fd)
    return files


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # the fd-based rmtree on Linux never follows symlinks
    else:
        path.unlink()


def _link(source: Path, target: Path) -> bool:
    try:
        os.link(source, target, follow_symlinks=False)
        return True
    except FileNotFoundError:  # the parent snapshot was deleted or pruned: copy instead
        return False


def _copy_file(
    source: Path, target: Path, *, mode: int, uid: int | None = None, mtime_ns: int | None = None
) -> None:
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            raise OSError(f"{source} is no longer a regular file")
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            offset = 0
            while sent := os.sendfile(dst, src, offset, 1 << 30):
                offset += sent
            if uid is not None:
                os.fchown(dst, uid, uid)
            os.fchmod(dst, mode)
            if mtime_ns is not None:
                os.utime(dst, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)
