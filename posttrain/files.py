"""Durable file operations: what survives a kill at any instruction, for everything that writes
a run directory (checkpoints, metrics, manifests, the final model, the budget cache).

A file or directory is written under a temporary name, fsynced, renamed into place and its parent
directory fsynced, so a reader sees the old content or the new, never a mix; a tree is removed by
renaming it away first. Content is identified by sha256.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Held while other processes sharing `path` (a lock file, created if missing) wait: around a
    read-merge-write of a file several processes update (the budget cache, a replay cache)."""
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a file's fsync does not cover its dir)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


RECENT_NS = 2_000_000_000


def sha256_known(path: Path, known: dict[str, list]) -> str:
    """`sha256_file(path)`, taken from `known` (absolute path -> [size, mtime_ns, sha256]) when the
    file's size and mtime are as recorded there, else read and recorded: a data set of gigabytes is
    not read again on every `plan` (trusting size and mtime, as `plan` trusts a model's files)."""
    stat = path.stat()
    entry = known.get(str(path))
    if entry is not None and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
        return entry[2]
    digest = sha256_file(path)
    # A file written in the last seconds is not recorded: an edit of the same size within the
    # filesystem's mtime resolution (a second on some) would otherwise keep its recorded digest.
    if time.time_ns() - stat.st_mtime_ns > RECENT_NS:
        known[str(path)] = [stat.st_size, stat.st_mtime_ns, digest]
    return digest


def hash_tree(directory: Path, known: dict[str, list] | None = None) -> tuple[dict[str, str], str]:
    """({relative file: sha256}, digest of that listing) for a model dir; `known`: see sha256_known."""
    files = {
        str(p.relative_to(directory)): sha256_file(p) if known is None else sha256_known(p, known)
        for p in sorted(Path(directory).rglob("*"))
        if p.is_file()
    }
    return files, hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so a reader sees the old or the new content, never a mix."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        # A full disk fails the write: `path` keeps its old content and no half-written
        # temporary is left beside it (each attempt's would pile up in the stage dir).
        tmp.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.filename is None:
            error.filename = str(path)  # a failed flush names no file: say which write failed
        raise
    fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """Delete a directory so that it disappears at once: a kill during a plain rmtree would leave
    a half-deleted dir that looks like a damaged checkpoint or model."""
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_trash(directory: Path) -> None:
    """Finish the deletions a kill cut short: the `.trash-*` trees `remove_tree` leaves in
    `directory` when it dies during the rmtree (a 3.5B stage's checkpoints are 42 GB each)."""
    for trash in Path(directory).glob(".trash-*"):
        shutil.rmtree(trash, ignore_errors=True)


def remove_dead_writers(directory: Path, prefix: str) -> None:
    """Remove the temporary dirs `prefix`PID in `directory` whose writer is no longer running: what
    a SIGKILLed `new_dir` left (an exported 3.5B model is 7-14 GB). The prefix names this host, so
    a writer on another host sharing the filesystem is never taken for a dead one here."""
    for path in directory.glob(f"{glob.escape(prefix)}*"):
        pid = path.name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid() and not process_running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def process_running(pid: int) -> bool:
    """Whether process `pid` exists on this host (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextmanager
def new_dir(out_dir: Path, replace: bool = False) -> Iterator[Path]:
    """A directory written whole or not at all: yields a temporary sibling to fill, renamed to
    `out_dir` when the block ends, removed if it raises. `out_dir` must be new or empty, unless
    `replace`: then what it holds is removed only once the new contents are complete. The siblings
    earlier writers of `out_dir` on this host left when they were killed are removed first."""
    if not replace and out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty: choose a new directory or remove it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out_dir.name}.tmp-{socket.gethostname()}-"
    remove_dead_writers(out_dir.parent, prefix)
    tmp = out_dir.with_name(f"{prefix}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if replace:
            shutil.rmtree(out_dir, ignore_errors=True)
        elif out_dir.exists():
            out_dir.rmdir()  # still empty, or this fails rather than lose what appeared in it
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
