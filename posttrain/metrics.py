"""Per-stage training metrics: one JSON line per logged step plus TensorBoard events.

metrics.jsonl is the record reports and tests read (plain text, survives anything); TensorBoard
is for looking at a live run. A checkpoint remembers how many records had been logged when it was
saved; after a resume the stage replays what it logged past that checkpoint, so `truncate(records)`
drops those lines and starts the next event file with TensorBoard's `purge_step`, which hides the
abandoned events: each record appears once, exactly as in an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from posttrain.files import atomic_write_text

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLogger:
    """`log(step, {"loss": 1.2})` or `log(step, loss=1.2)` appends to <stage_dir>/metrics.jsonl
    and to TensorBoard under <stage_dir>/tensorboard/. Values are floats (tensors and numpy
    scalars are converted); names may contain "/" (e.g. "response_length/low")."""

    def __init__(self, stage_dir: Path, tensorboard: bool = True) -> None:
        self.path = Path(stage_dir) / METRICS_FILE
        self.tensorboard_dir = Path(stage_dir) / TENSORBOARD_DIR
        self.tensorboard = tensorboard
        self._writer: Any = None
        self._purge_step: int | None = None
        self.last: dict[str, float] = {}
        self.records = len(read_metrics(self.path))

    def log(self, step: int, metrics: Mapping[str, Any] | None = None, /, **more: Any) -> None:
        values = {name: float(value) for name, value in {**(metrics or {}), **more}.items()}
        if "step" in values or "time" in values:
            raise ValueError("metric names 'step' and 'time' are reserved")
        record = {"step": int(step), "time": round(time.time(), 3), **values}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        self.records += 1
        self.last.update(values)
        if self.tensorboard:
            writer = self._tensorboard()
            for name, value in values.items():
                if math.isfinite(value):
                    writer.add_scalar(name, value, int(step))

    def truncate(self, records: int) -> None:
        """Keep the first `records` records (what was logged when the restored checkpoint was
        saved) and forget the rest."""
        kept = read_metrics(self.path)[:records]
        if self.path.exists():
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.records = len(kept)
        self.last = {}
        for record in kept:
            self.last.update({k: v for k, v in record.items() if k not in ("step", "time")})
        self.close()
        self._purge_step = kept[-1]["step"] + 1 if kept else 0

    def medians(self, names: Iterable[str]) -> dict[str, float]:
        """`<name>_median` ("/" written "_") of each named metric over the records that have it
        (a stage's steps, each once after a resume): a rate's typical step, which a slow first step
        (warm-up, compilation) moves less than it moves the mean. A name never logged is left out."""
        records = read_metrics(self.path)
        found = {name: [r[name] for r in records if name in r] for name in names}
        return {f"{name.replace('/', '_')}_median": statistics.median(v) for name, v in found.items() if v}

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _tensorboard(self) -> Any:
        if self._writer is None:
            # Imported on first use: it costs seconds and stages that log nothing need not pay.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=self._purge_step)
            self._purge_step = None
        return self._writer


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a torn last line (the writer was killed) is skipped."""
    if not Path(path).exists():
        return []
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records
