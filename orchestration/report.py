"""DIR/report.md: every stage's final metrics in one table, and PNG plots of the curves that tell
whether the recipe worked (loss, reward, response length by effort, MOPD KL).

A curve is plotted when a stage logged a metric with that name, alone or as a path part:
`loss`, `sft/loss`, `response_length/low` all count. Response length is split by reasoning effort:
the effort of an RL specialist's matrix, or the `/low|/high|/max` suffix a MOPD stage logs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

from orchestration.pipeline import Pipeline
from orchestration.rundir import read_manifest, stage_dir
from posttrain.metrics import METRICS_FILE, read_metrics

REPORT = "report.md"
PLOTS_DIR = "plots"
# plot file stem -> (title, metric base name)
PLOTS = {
    "loss": ("Training loss", "loss"),
    "reward": ("Reward", "reward"),
    "response_length": ("Response length by effort", "response_length"),
    "mopd_kl": ("MOPD KL (student vs teacher)", "kl"),
}


Series = tuple[str, str, list[int], list[float]]  # (stage, metric, steps, values)


def collect_series(pipeline: Pipeline, run_dir: Path, base: str) -> list[Series]:
    series = []
    for sid in pipeline.stages:
        by_name: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
        for record in read_metrics(stage_dir(run_dir, sid) / METRICS_FILE):
            for name, value in record.items():
                if (
                    name not in ("step", "time")
                    and isinstance(value, int | float)
                    and base in name.split("/")
                ):
                    by_name[name][0].append(record["step"])
                    by_name[name][1].append(float(value))
        series += [(sid, name, steps, values) for name, (steps, values) in sorted(by_name.items())]
    return series


def _effort(pipeline: Pipeline, series: Series) -> str:
    sid, name, _, _ = series
    suffix = name.rsplit("/", 1)[-1]
    if suffix in ("low", "high", "max"):
        return suffix
    return str(pipeline.stages[sid].matrix.get("effort", "all"))


def plot(pipeline: Pipeline, run_dir: Path, stem: str) -> Path | None:
    """Write DIR/plots/<stem>.png; None when no stage logged that metric."""
    title, base = PLOTS[stem]
    series = collect_series(pipeline, run_dir, base)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    groups: dict[str, list[Series]] = defaultdict(list)
    for item in series:
        groups[_effort(pipeline, item) if stem == "response_length" else ""].append(item)
    order = sorted(groups, key=lambda g: (["low", "high", "max", "all", ""] + [g]).index(g))
    fig, axes = plt.subplots(1, len(order), figsize=(5 * len(order), 3.6), squeeze=False)
    for ax, group in zip(axes[0], order, strict=True):
        for sid, name, steps, values in groups[group]:
            ax.plot(steps, values, label=sid if name == base else f"{sid} {name}", linewidth=1.2)
        ax.set_title(f"{title}: {group}" if group else title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = run_dir / PLOTS_DIR / f"{stem}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(pipeline: Pipeline, run_dir: Path) -> Path:
    """Write DIR/report.md (and its plots) from the manifests and metrics.jsonl files."""
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        f"Pipeline `{pipeline.root.name}`, written {time.strftime('%Y-%m-%d %H:%M:%S')}.",
        "",
        "| stage | kind | status | attempts | time (s) | final metrics |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for sid, stage in pipeline.stages.items():
        manifest = read_manifest(stage_dir(run_dir, sid)) or {}
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(manifest.get("metrics", {}).items()))
        seconds = manifest.get("run_seconds")
        lines.append(
            f"| {sid} | {stage.kind} | {manifest.get('status', 'pending')} | {manifest.get('attempts', 0)} "
            f"| {f'{seconds:.1f}' if seconds is not None else ''} | {metrics} |"
        )
    for old in (run_dir / PLOTS_DIR).glob("*.png"):
        old.unlink()  # a curve no longer logged must not linger from an earlier run
    figures = [(stem, path) for stem in PLOTS if (path := plot(pipeline, run_dir, stem)) is not None]
    if figures:
        lines += ["", "## Curves", ""]
        for stem, path in figures:
            lines += [f"### {PLOTS[stem][0]}", "", f"![{stem}]({path.relative_to(run_dir)})", ""]
    report = run_dir / REPORT
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return report
