"""Atomic checkpoints that hold everything a stage needs to continue bit for bit.

A stage can be killed (`kill -9`, OOM, pre-emption) at any instruction. Exact resume needs two
things: a checkpoint is either wholly on disk or ignored, and it captures *all* state the rest of
the run depends on (weights, optimizer, scheduler, every RNG, data cursors, queued partial
rollouts). So a checkpoint is written into a temp dir in the same directory, every file and the
dir are fsynced, the dir is renamed into place, and only then the `latest` pointer file is
atomically replaced. Each checkpoint carries a manifest with the sha256 of its files; a corrupted
or half-written one is detected on load and the previous one is used, with a warning.

Layout: ``<dir>/step-<N>/{checkpoint.json, model.safetensors, optimizer.pt, scheduler.pt, rng.pt,
extra.pt, samples-<name>.jsonl, ...}`` and ``<dir>/latest`` containing ``step-<N>``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.data.sample import Sample
from posttrain.files import atomic_write_text, fsync_dir, fsync_file, remove_trash, remove_tree, sha256_file

if TYPE_CHECKING:
    from posttrain.metrics import MetricsLogger  # the logger whose lines a restore cuts back

LOG = logging.getLogger("posttrain.checkpoint")
MANIFEST = "checkpoint.json"
CHECKPOINTS_DIR = "checkpoints"  # a stage's checkpoints: DIR/<stage>/checkpoints
KEEP_CHECKPOINTS = 3  # a stage's newest checkpoints kept, unless its file sets keep_checkpoints
POINTER = "latest"


def capture_rng_state() -> dict[str, Any]:
    """Every global RNG a training step may draw from: python `random`, numpy's legacy global,
    torch CPU, and CUDA when it has been initialised (an uninitialised CUDA RNG is still in the
    state `torch.manual_seed` left it, which a resumed run reproduces by seeding)."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint_step(directory: Path) -> int | None:
    """The step named by the `latest` pointer in `directory` (not verified), or None. Only reads,
    so `plan` can show where a stage would resume without touching its files."""
    try:
        name = (Path(directory) / POINTER).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    suffix = name.removeprefix("step-")
    return int(suffix) if name.startswith("step-") and suffix.isdigit() else None


@dataclass
class Checkpoint:
    """What `CheckpointManager.load` found: the step it was saved at, the directory (for files a
    `write_files` hook added), the `extra` state and the queued `samples` by name."""

    step: int
    path: Path
    extra: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, list[Sample]] = field(default_factory=dict)


def _named(obj: Any, role: str) -> dict[str, Any]:
    """A single object or a mapping of name -> object, as {file stem: object}."""
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return {f"{role}-{name}": value for name, value in obj.items()}
    return {role: obj}


def _check_plain(value: Any, where: str) -> None:
    """`extra` is loaded with torch.load(weights_only=True) so a checkpoint can never run code;
    reject what that loader refuses at save time, where the caller can still fix it."""
    import torch

    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise TypeError(f"checkpoint extra{where}: dict key {key!r} must be str or int")
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"checkpoint extra{where}: {type(value).__name__} cannot be stored; use tensors, numbers, "
        "strings, lists and dicts (numpy arrays: torch.from_numpy; objects: their state dict)"
    )


class CheckpointManager:
    """Atomic save / verified load of training state under `directory`, keeping the last `keep`.

    keep: 0 writes no checkpoint at all (`save` returns None): the stage cannot resume and a rerun
      starts it over. For a machine whose disk cannot hold one (a 3.5B-parameter stage's weights
      and AdamW moments are 42 GB), not for a run that may be interrupted.

    metrics: the stage's MetricsLogger. Each checkpoint records how many metric records had been
      logged when it was saved, and `load` cuts metrics.jsonl back to that (to nothing when there
      is no checkpoint), so a resumed stage's metrics equal an uninterrupted run's. Log a step's
      metrics before saving its checkpoint.
    on_restore(step): called after every `load` (step 0 when nothing was restored).
    """

    def __init__(
        self,
        directory: Path,
        keep: int = KEEP_CHECKPOINTS,
        log: logging.Logger | None = None,
        metrics: MetricsLogger | None = None,
        on_restore: Callable[[int], None] | None = None,
    ) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.log = log or LOG
        self.metrics = metrics
        self.on_restore = on_restore
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        remove_trash(self.directory)

    def steps(self) -> list[int]:
        """Steps with a checkpoint directory on disk (not verified), ascending."""
        found = []
        for path in self.directory.glob("step-*"):
            suffix = path.name.removeprefix("step-")
            if path.is_dir() and suffix.isdigit():
                found.append(int(suffix))
        return sorted(found)

    def latest_step(self) -> int | None:
        """The step the `latest` pointer names (not verified), or None."""
        return latest_checkpoint_step(self.directory)

    def save(
        self,
        step: int,
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        extra: Mapping[str, Any] | None = None,
        samples: Mapping[str, Iterable[Sample]] | None = None,
        rng: bool = True,
        write_files: Callable[[Path], None] | None = None,
    ) -> Path | None:
        """Write checkpoint `step` atomically and point `latest` at it (nothing, None, when
        `keep` is 0).

        model / optimizer / scheduler: one object or a mapping name -> object (several models).
          Models are saved with safetensors (shared tensors handled), optimizers and schedulers as
          their state dicts.
        extra: any state of tensors, numbers, strings, lists and dicts (data cursor, router bias,
          engine policy version, numpy Generator.bit_generator.state, ...).
        samples: named queues of `Sample` (e.g. {"rollout_queue": paused}) stored as JSONL.
        rng: store every global RNG (see capture_rng_state).
        write_files: called with the temp dir to add files of your own (e.g. a sharded optimizer);
          they are hashed and verified like the rest.
        """
        import torch
        from safetensors.torch import save_model

        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        if self.keep == 0:
            return None
        if extra is not None:
            _check_plain(dict(extra), "")
        tmp = self.directory / f".tmp-step-{step}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        for stem, module in _named(model, "model").items():
            save_model(module, str(tmp / f"{stem}.safetensors"), force_contiguous=True)
        for stem, obj in {**_named(optimizer, "optimizer"), **_named(scheduler, "scheduler")}.items():
            torch.save(obj.state_dict(), tmp / f"{stem}.pt")
        if rng:
            torch.save(capture_rng_state(), tmp / "rng.pt")
        if extra is not None:
            torch.save(dict(extra), tmp / "extra.pt")
        for name, queue in (samples or {}).items():
            with open(tmp / f"samples-{name}.jsonl", "w", encoding="utf-8") as handle:
                for sample in queue:
                    handle.write(sample.to_json() + "\n")
        if write_files is not None:
            write_files(tmp)
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            fsync_file(path)
            files[str(path.relative_to(tmp))] = sha256_file(path)
        manifest = {
            "format": 1,
            "step": step,
            "time": time.time(),
            "files": files,
            "metrics_records": self.metrics.records if self.metrics is not None else None,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        fsync_file(tmp / MANIFEST)
        fsync_dir(tmp)
        final = self.directory / f"step-{step}"
        # A dir for this step exists only when a later checkpoint was found corrupt and the run
        # went back; the old one is from the abandoned attempt.
        remove_tree(final)
        os.rename(tmp, final)
        fsync_dir(self.directory)
        atomic_write_text(self.directory / POINTER, f"step-{step}\n")
        self._prune(step)
        return final

    def load(
        self,
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        restore_rng: bool = True,
        map_location: str = "cpu",
    ) -> Checkpoint | None:
        """Restore the newest intact checkpoint into the given objects; None when there is none.

        The objects must have the same structure as at save time (same names when mappings).
        A checkpoint whose files do not match its manifest is skipped with a warning.
        """
        import torch
        from safetensors.torch import load_model

        path = self._newest_valid()
        if path is None:
            if self.metrics is not None:
                self.metrics.truncate(0)
            if self.on_restore is not None:
                self.on_restore(0)
            return None
        for stem, module in _named(model, "model").items():
            load_model(module, str(path / f"{stem}.safetensors"), strict=True, device=map_location)
        for stem, obj in {**_named(optimizer, "optimizer"), **_named(scheduler, "scheduler")}.items():
            obj.load_state_dict(torch.load(path / f"{stem}.pt", map_location=map_location, weights_only=True))
        if restore_rng and (path / "rng.pt").exists():
            restore_rng_state(torch.load(path / "rng.pt", weights_only=True))
        extra = {}
        if (path / "extra.pt").exists():
            extra = torch.load(path / "extra.pt", map_location=map_location, weights_only=True)
        samples = {}
        for queue in sorted(path.glob("samples-*.jsonl")):
            lines = queue.read_text(encoding="utf-8").splitlines()
            samples[queue.stem.removeprefix("samples-")] = [Sample.from_json(line) for line in lines if line]
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        step = manifest["step"]
        if self.metrics is not None and manifest.get("metrics_records") is not None:
            self.metrics.truncate(manifest["metrics_records"])
        if self.on_restore is not None:
            self.on_restore(step)
        return Checkpoint(step=step, path=path, extra=extra, samples=samples)

    def verify(self, path: Path) -> str | None:
        """Why the checkpoint at `path` is unusable, or None when every file matches its hash."""
        try:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
            files = manifest["files"]
            step = manifest["step"]
        except FileNotFoundError:
            return f"{MANIFEST} is missing"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{MANIFEST} is unreadable ({exc})"
        if path.name != f"step-{step}":
            return f"{MANIFEST} says step {step}"
        for name, expected in files.items():
            file = path / name
            if not file.is_file():
                return f"{name} is missing"
            if sha256_file(file) != expected:
                return f"{name} does not match its sha256"
        return None

    def _newest_valid(self) -> Path | None:
        step = latest_checkpoint_step(self.directory)
        pointed = f"step-{step}" if step is not None else None
        candidates = [f"step-{s}" for s in reversed(self.steps())]
        if pointed:
            candidates = [pointed] + [c for c in candidates if c != pointed]
        rejected = []
        for name in candidates:
            path = self.directory / name
            problem = self.verify(path) if path.is_dir() else "directory is missing"
            if problem is None:
                if rejected:
                    self.log.warning(
                        "checkpoint %s is damaged (%s); resuming from %s instead",
                        rejected[0][0],
                        rejected[0][1],
                        path,
                    )
                return path
            rejected.append((self.directory / name, problem))
        if rejected:
            self.log.warning(
                "no intact checkpoint in %s (%s: %s); starting from scratch",
                self.directory,
                rejected[0][0].name,
                rejected[0][1],
            )
        return None

    def _prune(self, saved: int) -> None:
        steps = self.steps()
        newer = [s for s in steps if s > saved]
        older = [s for s in steps if s <= saved]
        # Steps after the one just saved belong to an attempt that was abandoned for a damaged
        # checkpoint: they are not part of this run's history.
        for step in newer + older[: max(0, len(older) - self.keep)]:
            remove_tree(self.directory / f"step-{step}")
