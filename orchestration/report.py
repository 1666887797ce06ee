"""DIR/report.md: every stage's final metrics in one table, the RL and MOPD evaluations with their
standard errors, the default recipe's claims (orchestration.outcomes), and PNG plots of the curves
that tell whether the recipe worked (loss, reward, response length by effort, MOPD KL).

Each plot lists the metric names the stage kinds log, in order of preference; a stage contributes
the first one it logged, alone or as a path part (`loss`, `sft/loss`, `kl/agent-high`). Curves
whose scales differ are drawn on separate axes: loss and reward per stage kind (SFT's token loss,
RL's policy loss, MOPD's near-zero loss with its baseline), response length per reasoning effort
(the effort of an RL specialist's matrix, or the `/low|/high|/max` suffix a MOPD stage logs).
"""

from __future__ import annotations

import io
import time
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path
from typing import Any

from orchestration.outcomes import DamagedEvalError, claims_table, read_eval, run_claims
from orchestration.pipeline import Pipeline
from orchestration.rundir import read_manifest, recorded_damage, recorded_status, stage_dir
from posttrain.files import atomic_write_bytes, atomic_write_text
from posttrain.metrics import METRICS_FILE, read_metrics

REPORT = "report.md"
PLOTS_DIR = "plots"
# plot file stem -> (title, metric names in order of preference): sft logs `loss`; rl `loss`
# (`pg_loss` beside it), `reward_mean`, `response_tokens_mean`; mopd `loss`, `reward`,
# `response_length/<effort>`, `kl` and `kl/<domain>-<effort>`.
PLOTS = {
    "loss": ("Training loss", ("loss", "pg_loss")),
    "reward": ("Reward", ("reward_mean", "reward")),
    "response_length": ("Response length by effort", ("response_tokens_mean", "response_length")),
    "mopd_kl": ("MOPD KL (student vs teacher)", ("kl",)),
}
# How a plot's curves are split into axes: by the stage's kind, or by reasoning effort.
SPLIT = {"loss": "kind", "reward": "kind", "response_length": "effort", "mopd_kl": ""}
# Final metrics shown first, in this order (the rest follow alphabetically).
HEADLINE = (
    "reward_mean",
    "task_reward_mean",
    "kl_after",
    "kl_exact_after",
    "pairs_kl_improved",
    "accuracy_after",
    "eval_loss_after",
    "tool_success_after",
    "train_loss",
    "loss",
)

Series = tuple[str, str, list[int], list[float]]  # (stage, metric, steps, values)


def headline_order(metrics: dict[str, Any]) -> list[tuple[str, Any]]:
    """Final metrics in reading order: HEADLINE names, then the other plain names, then the
    breakdowns (`a/b`)."""
    rank = {name: i for i, name in enumerate(HEADLINE)}
    return sorted(metrics.items(), key=lambda kv: (rank.get(kv[0], len(rank)), "/" in kv[0], kv[0]))


def is_timing(name: str) -> bool:
    """Seconds and rates (`eval_s_after`, `train_tokens_per_s`): kept in the manifest, not shown."""
    return "s" in name.rsplit("/", 1)[-1].split("_")


def table_metrics(metrics: dict[str, Any]) -> str:
    """The report table's cell: no timings and no breakdown that is 0 (a wall of
    `data/skipped/*=0` hides the numbers that matter)."""
    shown = [(k, v) for k, v in headline_order(metrics) if not is_timing(k) and not ("/" in k and v == 0)]
    return ", ".join(f"{k}={v:.4g}" for k, v in shown)


def collect_series(pipeline: Pipeline, run_dir: Path, names: tuple[str, ...]) -> list[Series]:
    """Per stage, the curves of the first of `names` it logged (with its `/` breakdowns)."""
    series = []
    for sid in pipeline.stages:
        by_base: dict[str, dict[str, tuple[list[int], list[float]]]] = defaultdict(
            lambda: defaultdict(lambda: ([], []))
        )
        for record in read_metrics(stage_dir(run_dir, sid) / METRICS_FILE):
            for name, value in record.items():
                if name in ("step", "time") or not isinstance(value, int | float):
                    continue
                for base in names:
                    if base in name.split("/"):
                        by_base[base][name][0].append(record["step"])
                        by_base[base][name][1].append(float(value))
                        break
        base = next((b for b in names if b in by_base), None)
        if base is not None:
            series += [(sid, name, steps, values) for name, (steps, values) in sorted(by_base[base].items())]
    return series


def _effort(pipeline: Pipeline, series: Series) -> str:
    sid, name, _, _ = series
    suffix = name.rsplit("/", 1)[-1]
    if suffix in ("low", "high", "max"):
        return suffix
    return str(pipeline.stages[sid].matrix.get("effort", "all"))


def plot_groups(pipeline: Pipeline, run_dir: Path, stem: str) -> dict[str, list[Series]]:
    """axis title -> the curves drawn on it, in display order; empty when nothing was logged."""
    groups: dict[str, list[Series]] = defaultdict(list)
    for item in collect_series(pipeline, run_dir, PLOTS[stem][1]):
        if SPLIT[stem] == "effort":
            key = _effort(pipeline, item)
        elif SPLIT[stem] == "kind":
            key = pipeline.stages[item[0]].kind
        else:
            key = ""
        groups[key].append(item)
    known = ["sft", "rl", "mopd", "low", "high", "max", "all", ""]
    order = sorted(groups, key=lambda g: (known.index(g) if g in known else len(known), g))
    return {g: groups[g] for g in order}


def draw(groups: dict[str, list[Series]], title: str) -> Any:
    """One matplotlib figure, one axis per group; steps are integers and so are the ticks."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.6), squeeze=False)
    for ax, (group, series) in zip(axes[0], groups.items(), strict=True):
        bases = {name.split("/")[0] for _, name, _, _ in series}
        for sid, name, steps, values in series:
            label = sid if name in bases and len(bases) == 1 else f"{sid} {name}"
            ax.plot(steps, values, label=label, linewidth=1.2, marker="." if len(steps) < 20 else None)
        ax.set_title(f"{title}: {group}" if group else title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot(pipeline: Pipeline, run_dir: Path, stem: str) -> Path | None:
    """Write DIR/plots/<stem>.png; None when no stage logged that metric."""
    groups = plot_groups(pipeline, run_dir, stem)
    if not groups:
        return None
    import matplotlib.pyplot as plt

    fig = draw(groups, PLOTS[stem][0])
    path = run_dir / PLOTS_DIR / f"{stem}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    # Atomic: `posttrain report` may draw while the run's own report does (or be killed mid-write).
    atomic_write_bytes(path, png.getvalue())
    return path


def report_statuses(
    pipeline: Pipeline, run_dir: Path, blocked: Collection[str] | None = None
) -> dict[str, str]:
    """Each stage's status as report.md shows it: as `posttrain status` reads it from the stage's
    dir (rundir.recorded_status; damaged where rundir.recorded_damage says so), and blocked for a
    stage without a manifest that a run did not start because a need failed. `blocked`: those
    stages as the run that just ended knows them; None (`posttrain report`): those whose need
    failed or is itself blocked."""
    statuses: dict[str, str] = {}
    for sid, stage in pipeline.stages.items():
        directory = stage_dir(run_dir, sid)
        manifest = read_manifest(directory)
        if blocked is None:
            kept_back = any(statuses[need] in ("failed", "blocked") for need in stage.needs)
        else:
            kept_back = sid in blocked
        # A stage with a manifest started: what it records is its status, not its needs'.
        status = "blocked" if manifest is None and kept_back else recorded_status(directory, manifest or {})
        statuses[sid] = "damaged" if recorded_damage(directory, manifest or {}, status) else status
    return statuses


def write_report(pipeline: Pipeline, run_dir: Path, statuses: dict[str, str] | None = None) -> Path:
    """Write DIR/report.md (and its plots) from the manifests and metrics.jsonl files. `statuses`:
    each stage's, as `report_statuses` gives them (None: read here, blocked stages found from their
    needs' manifests)."""
    statuses = statuses if statuses is not None else report_statuses(pipeline, run_dir)
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        f"Pipeline `{pipeline.root.name}`, written {time.strftime('%Y-%m-%d %H:%M:%S')}. Final metrics "
        "without timings or zero breakdowns; every value is in DIR/<stage>/manifest.json.",
        "",
        "| stage | kind | status | attempts | time (s) | final metrics |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for sid, stage in pipeline.stages.items():
        manifest = read_manifest(stage_dir(run_dir, sid)) or {}
        seconds = manifest.get("run_seconds")
        lines.append(
            f"| {sid} | {stage.kind} | {statuses[sid]} | {manifest.get('attempts', 0)} "
            f"| {f'{seconds:.1f}' if seconds is not None else ''} | "
            f"{table_metrics(manifest.get('metrics', {}))} |"
        )
    lines += evaluation_sections(pipeline, run_dir)
    for old in (run_dir / PLOTS_DIR).glob("*.png"):
        # A curve no longer logged must not linger from an earlier run; a report drawn at the same
        # time (`posttrain report` during a run) may have removed it first.
        old.unlink(missing_ok=True)
    figures = [(stem, path) for stem in PLOTS if (path := plot(pipeline, run_dir, stem)) is not None]
    if figures:
        lines += ["", "## Curves", ""]
        for stem, path in figures:
            lines += [f"### {PLOTS[stem][0]}", "", f"![{stem}]({path.relative_to(run_dir)})", ""]
    report = run_dir / REPORT
    atomic_write_text(report, "\n".join(lines) + "\n")
    return report


def _protocol(report: dict) -> str:
    """How an RL eval.json's episodes were played (older files, without the keys, were greedy)."""
    temperature, k = report.get("temperature", 0.0), report.get("samples_per_prompt", 1)
    if not temperature:
        return "greedy"
    return f"sampled at temperature {temperature:g}, {k} episode{'s' if k > 1 else ''} a prompt"


def _pm(value: float, se: float, digits: int = 3) -> str:
    return f"{value:.{digits}f} ± {se:.{digits}f}"


def _change(change: float, se: float, digits: int = 3) -> str:
    z = f", z {change / se:+.1f}" if se > 0 else ""
    return f"{change:+.{digits}f} ± {se:.{digits}f}{z}"


def evaluation_sections(pipeline: Pipeline, run_dir: Path) -> list[str]:
    """Markdown for the RL stages' and MOPD stages' eval.json (estimates ± standard error, changes
    ± paired standard error and their z) and the claims they support; empty when none exists. A
    damaged evaluation file is named in their place: the report is written at the end of every
    run, which must not end in a traceback over a file only the report reads."""
    try:
        return _evaluation_sections(pipeline, run_dir)
    except DamagedEvalError as error:
        return ["", "## Evaluations", "", f"Not shown: {error}."]


def _evaluation_sections(pipeline: Pipeline, run_dir: Path) -> list[str]:
    lines: list[str] = []
    rl_files = [
        (sid, stage_dir(run_dir, sid) / "eval.json") for sid, st in pipeline.stages.items() if st.kind == "rl"
    ]
    rl = [(sid, report) for sid, path in rl_files if (report := read_eval(path)) is not None]
    if rl:
        lines += [
            "",
            "## RL evaluations",
            "",
            f"Held-out prompts, {_protocol(rl[0][1])}; ± one standard error over prompts; changes "
            'paired (the same episodes before and after). A row "stage (subset)" is an eval subset: '
            "its own prompts of some of the domain's families and episodes a prompt (eval.json).",
            "",
            "| stage | prompts | SFT accuracy | accuracy | change | SFT tokens | tokens | change |",
            "| --- | ---: | --- | --- | --- | --- | --- | --- |",
        ]
        rows = [  # each stage, then its eval subsets (their own prompts) as "stage (subset)"
            (label, r)
            for sid, report in rl
            for label, r in [
                (sid, report),
                *((f"{sid} ({n})", x) for n, x in report.get("subsets", {}).items()),
            ]
        ]
        for label, r in rows:
            if "accuracy_change_se" not in r:
                continue  # written by an older version, without errors
            lines.append(
                f"| {label} | {r['prompts']} | {_pm(r['sft']['accuracy'], r['sft']['accuracy_se'])} "
                f"| {_pm(r['accuracy'], r['accuracy_se'])} "
                f"| {_change(r['accuracy_change'], r['accuracy_change_se'])} "
                f"| {_pm(r['sft']['mean_response_tokens'], r['sft']['mean_response_tokens_se'], 1)} "
                f"| {_pm(r['mean_response_tokens'], r['mean_response_tokens_se'], 1)} "
                f"| {_change(r['mean_response_tokens_change'], r['mean_response_tokens_change_se'], 1)} |"
            )
    for sid, stage in pipeline.stages.items():
        report = read_eval(stage_dir(run_dir, sid) / "eval.json") if stage.kind == "mopd" else None
        if report is None:
            continue
        lines += [
            "",
            f"## MOPD evaluation: {sid}",
            "",
            "Per pair: reverse KL to its teacher (exact where measured, else sampled) and accuracy "
            "(played as the RL evaluations play it), before -> after; changes ± paired standard error.",
            "",
            "| pair | KL before | KL after | change | accuracy before | accuracy after | change |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for pair, r in report.items():
            kl = "kl_exact" if "kl_exact_before" in r else "kl"
            se_b, se_a = r.get(f"{kl}_se_before", 0.0), r.get(f"{kl}_se_after", 0.0)
            change = r[f"{kl}_after"] - r[f"{kl}_before"]
            lines.append(
                f"| {pair} | {_pm(r[f'{kl}_before'], se_b, 4)} | {_pm(r[f'{kl}_after'], se_a, 4)} "
                f"| {_change(change, r.get(f'{kl}_change_se', 0.0), 4)} "
                f"| {_pm(r['accuracy_before'], r.get('accuracy_se_before', 0.0))} "
                f"| {_pm(r['accuracy_after'], r.get('accuracy_se_after', 0.0))} "
                f"| {_change(r.get('accuracy_change', 0.0), r.get('accuracy_change_se', 0.0))} |"
            )
    claims = run_claims(run_dir)
    if claims:
        lines += ["", "## Claims of the default recipe (this run)", "", *claims_table(claims)]
    return lines
