"""`posttrain`: run, plan and inspect a staged post-training pipeline.

    posttrain run FILE [--run-dir DIR] [--only STAGE] [--from STAGE] [--restart STAGE]
                       [--executor local|ray] [--max-parallel N] [--ray-address ADDR] [KEY=VALUE ...]
    posttrain plan FILE [--run-dir DIR] [KEY=VALUE ...]
    posttrain status DIR
    posttrain report FILE [--run-dir DIR] [KEY=VALUE ...]
    posttrain export RUN_DIR/STAGE --format bf16|mxfp4 --out DIR [--max-shard-size SIZE]
    posttrain --version

Exit codes: 0 success, 1 a stage failed, 2 a user error (stage files, overrides, flags, run dir,
a full disk), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM); both stop the running stages
first, and the same command resumes. User errors print file:line: key: problem (hint), never a traceback.
Progress: bars on a terminal; a plain line per event when stdout is not one (CI, nohup, a pipe).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.markup import escape

import orchestration._quiet  # noqa: F401  (first: before anything imports transformers)
from orchestration.console import (
    LineDisplay,
    RichDisplay,
    plan_table,
    print_config_error,
    status_table,
    summary_lines,
    summary_table,
)
from orchestration.executors import busy_machine_warning, check_local_gpus, execute, start_fork_server
from orchestration.pipeline import Pipeline, load_pipeline
from orchestration.report import REPORT, report_statuses, write_report
from orchestration.rundir import (
    DAMAGED_PIPELINE,
    MANIFEST,
    PIPELINE,
    StageLock,
    StageState,
    continue_restart,
    model_damage,
    pipeline_damaged,
    plan_states,
    read_manifest,
    read_pipeline,
    restart_finished,
    write_pipeline,
)
from orchestration.runner import MODEL_DIR, RUN_LOG
from posttrain import __version__
from posttrain.config.errors import ConfigError, Issue, did_you_mean

OVERRIDES_HELP = (
    "KEY=VALUE overrides: STAGE.key.path=value for the stages matching STAGE (an id or a glob "
    "like 'rl-*'), or key.path=value for every stage that has that key"
)


class _Parser(argparse.ArgumentParser):
    """`@FILE` on the command line reads more arguments from FILE, one per line, skipping blank
    lines and `#` comments: a profile of overrides (stages/profiles/one-gpu.args)."""

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        line = arg_line.split(" #", 1)[0].strip()
        return [] if not line or line.startswith("#") else [line]


def _parser(command: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=f"posttrain {command}", fromfile_prefix_chars="@")
    parser.set_defaults(command=command)
    if command in ("run", "plan", "report"):
        parser.add_argument("file", type=Path, help="stage file, e.g. stages/mopd.yaml")
        # default=[]: argparse otherwise lists the optional KEY=VALUE among the missing arguments
        parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help=OVERRIDES_HELP)
        parser.add_argument("--run-dir", type=Path, help="default: runs/<stem of FILE>")
    if command == "run":
        parser.add_argument(
            "--only",
            action="append",
            default=[],
            metavar="STAGE",
            help="run only this stage (repeatable); its needs must be done",
        )
        parser.add_argument(
            "--from",
            dest="from_stage",
            metavar="STAGE",
            help="rerun STAGE and every stage after it from scratch",
        )
        parser.add_argument(
            "--restart",
            action="append",
            default=[],
            metavar="STAGE",
            help="discard STAGE's checkpoints and results and run it again (repeatable)",
        )
        parser.add_argument("--executor", choices=("local", "ray"), default="local")
        parser.add_argument(
            "--max-parallel",
            type=int,
            metavar="N",
            help="stages running at once (default: as many as their resources.cpus fit in this machine "
            "(local) or the cluster (ray))",
        )
        parser.add_argument(
            "--ray-address", help="Ray cluster address (default: $RAY_ADDRESS, else a local instance)"
        )
    if command == "status":
        parser.add_argument("run_dir", type=Path, metavar="DIR")
    if command == "export":
        parser.add_argument("source", type=Path, metavar="RUN_DIR/STAGE", help="stage dir or model dir")
        parser.add_argument("--format", required=True, choices=("bf16", "mxfp4"), dest="fmt")
        parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="a new or empty directory")
        parser.add_argument(
            "--max-shard-size",
            default="5GB",
            type=_shard_size,
            help="shard above this size: a number with KB, MB, GB or TB (default 5GB)",
        )
    return parser


def _shard_size(text: str) -> int:
    """--max-shard-size in bytes, refused while parsing (exit 2 with usage), before anything loads."""
    from posttrain.export import ExportError, shard_size_bytes

    try:
        return shard_size_bytes(text)
    except ExportError as error:  # argparse names the flag already
        raise argparse.ArgumentTypeError(str(error).removeprefix("--max-shard-size ")) from None


def _stage_file(args: argparse.Namespace) -> Path:
    """FILE, refused when it is a directory: most likely a run dir, which `status` takes but these
    commands take after --run-dir (a run dir's pipeline.json names its stage file)."""
    if args.file.is_dir():
        recorded = (read_pipeline(args.file) or {}).get("file")
        hint = (
            f"posttrain {args.command} {recorded} --run-dir {args.file}"
            if recorded
            else "pass a stage file, e.g. stages/mopd.yaml"
        )
        raise ConfigError([Issue(str(args.file), "is a directory, not a stage file", hint=hint)])
    return args.file


def _run_of_stage_dir(path: Path) -> Path | None:
    """The run dir of `path` when `path` is one of its stage dirs (given where a run dir belongs)."""
    if (path / MANIFEST).is_file() and not (path / PIPELINE).is_file():
        return path.resolve().parent
    return None


def _run_dir(args: argparse.Namespace, create: bool = False) -> Path:
    """--run-dir (default runs/<stem of FILE>), checked: a file there, or a dir that cannot be
    made, is a user error rather than a traceback."""
    path = args.run_dir or Path("runs") / args.file.stem
    if path.exists() and not path.is_dir():
        raise ConfigError(
            [Issue(str(path), "--run-dir is a file, not a directory", hint="pass a directory path")]
        )
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                [
                    Issue(
                        str(path),
                        f"cannot create the run dir ({error.strerror or error})",
                        hint="pass a --run-dir you may write to",
                    )
                ]
            ) from None
    return path


def _select(
    pipeline: Pipeline, states: dict[str, StageState], args: argparse.Namespace
) -> tuple[list[str], set[str]]:
    """(stages in scope in dependency order, stages that must start over)."""
    issues = []
    named = [("--only", s) for s in args.only] + [("--restart", s) for s in args.restart]
    named += [("--from", args.from_stage)] if args.from_stage else []
    for flag, sid in named:
        if sid not in pipeline.stages:
            hint = did_you_mean(sid, pipeline.stages) or f"stages: {', '.join(pipeline.stages)}"
            issues.append(Issue("command line", f"{flag} {sid}: no such stage in {args.file}", hint=hint))
    if issues:
        raise ConfigError(issues)
    forced = set(args.restart)
    if args.from_stage:
        forced |= {args.from_stage} | pipeline.descendants(args.from_stage)
    if not args.only:
        return list(pipeline.stages), forced
    # A stage to rerun that --only leaves out would silently not run: say so instead.
    only = " ".join(f"--only {s}" for s in args.only)
    for flag, sid in named:
        if flag != "--only" and sid not in args.only:
            hint = f"add --only {sid}, or drop --only"
            issues.append(Issue("command line", f"{flag} {sid} is outside {only}", hint=hint))
    scope = [sid for sid in pipeline.stages if sid in args.only]
    for sid in scope:
        for need in pipeline.stages[sid].needs:
            if need not in args.only and states[need].status != "done":
                issues.append(
                    Issue(
                        "command line",
                        f"--only {sid}: its need {need} is {states[need].status} ({states[need].reason})",
                        hint=f"run {need} first, or add --only {need}",
                    )
                )
    if issues:
        raise ConfigError(issues)
    return scope, forced


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    pipeline = load_pipeline(_stage_file(args), args.overrides)
    run_dir = _run_dir(args)
    states = plan_states(pipeline, run_dir)
    console.print(plan_table(pipeline, states))
    console.print(_counts(run_dir, [st.status for st in states.values()]), highlight=False)
    for note in dict.fromkeys(str(n) for n in pipeline.unregistered.values()):
        console.print(f"* {note}", markup=False, highlight=False, soft_wrap=True)
    return 0


def _counts(run_dir: Path, statuses: list[str]) -> str:
    """`run dir DIR: 3 done, 1 failed`: how many stages are in each status."""
    order = ("done", "stale", "pending", "running", "failed", "blocked", "damaged")
    return f"run dir {run_dir}: " + ", ".join(f"{statuses.count(s)} {s}" for s in order if s in statuses)


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    """report.md and plots of a run dir as it is now: a run killed, run with --only, or running."""
    pipeline = load_pipeline(_stage_file(args), args.overrides)
    run_dir = _run_dir(args)
    _check_run_of(run_dir, pipeline, args.file)
    statuses = report_statuses(pipeline, run_dir)
    try:
        report = write_report(pipeline, run_dir, statuses)
    except PermissionError as error:  # another user's run dir: readable, not writable
        hint = "report on a copy you may write to: cp -r the run dir and pass the copy as --run-dir"
        raise ConfigError([Issue(error.filename or str(run_dir), "permission denied", hint=hint)]) from None
    console.print(f"report: {report}", markup=False, highlight=False, soft_wrap=True)
    console.print(_counts(run_dir, list(statuses.values())), highlight=False)
    return 0


def _check_run_of(run_dir: Path, pipeline: Pipeline, file: Path) -> None:
    """Refuse a run dir that holds no run of `pipeline`'s stage file (by its pipeline.json), so
    `report` never writes a report.md into a dir that is not a run of that file, nor a report of
    the wrong stages over another file's."""
    start = f"posttrain run {file} --run-dir {run_dir}"
    if not run_dir.is_dir():
        hint = f"pass the --run-dir of a run of {file}, or start one: {start}"
        raise ConfigError([Issue(str(run_dir), "run dir does not exist", hint=hint)])
    if run := _run_of_stage_dir(run_dir):
        hint = f"pass the run dir: posttrain report {file} --run-dir {run}"
        raise ConfigError([Issue(str(run_dir), f"is a stage dir of the run {run}", hint=hint)])
    path = run_dir / PIPELINE
    if pipeline_damaged(run_dir):
        hint = f"{start} writes it again; finished stages are not run again"
        raise ConfigError([Issue(str(path), DAMAGED_PIPELINE, hint=hint)])
    recorded = read_pipeline(run_dir)
    if recorded is None:
        raise ConfigError([Issue(str(path), "is missing: this dir holds no run", hint=f"start one: {start}")])
    if recorded.get("file") != str(pipeline.root):
        other = recorded.get("file")
        hint = f"posttrain report {other} --run-dir {run_dir}, or pass the --run-dir of {file}'s run"
        raise ConfigError(
            [Issue(str(path), f"the run in {run_dir} was made by {other}, not {pipeline.root}", hint=hint)]
        )


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    local = args.executor == "local"
    # Sampled first: the fork server's imports, started next, are this run's work, not other work.
    busy = busy_machine_warning(os.environ.get("OMP_WAIT_POLICY")) if local else None
    if local:
        start_fork_server()
    pipeline = load_pipeline(_stage_file(args), args.overrides)
    if args.max_parallel is not None and args.max_parallel < 1:
        raise ConfigError([Issue("command line", f"--max-parallel {args.max_parallel}: must be at least 1")])
    run_dir = _run_dir(args).resolve()
    states = plan_states(pipeline, run_dir)
    scope, forced = _select(pipeline, states, args)
    to_run = [sid for sid in scope if sid in forced or states[sid].status != "done"]
    unregistered = [pipeline.unregistered[sid] for sid in to_run if sid in pipeline.unregistered]
    if unregistered:
        raise ConfigError(unregistered)
    if local:  # Ray places stages on the cluster's GPUs, which this machine cannot count
        check_local_gpus(pipeline, scope, args.overrides)
    _run_dir(args, create=True)
    lock = StageLock(run_dir)
    if not lock.acquire(wait_s=0):
        raise ConfigError(
            [
                Issue(
                    str(run_dir),
                    f"another `posttrain run` (pid {lock.holder()}) is using this run dir",
                    hint="wait for it, or pass a different --run-dir",
                )
            ]
        )
    log = _driver_log(run_dir)
    try:
        # The same command after an interruption continues its --restart/--from, not begins it anew.
        forced = continue_restart(run_dir, forced)
        to_run = [sid for sid in scope if sid in forced or states[sid].status != "done"]
        write_pipeline(run_dir, pipeline, args.overrides)
        log.info("run %s: %d stages in scope, to run: %s", args.file, len(scope), ", ".join(to_run) or "none")
        if not to_run:
            console.print(
                f"all {len(scope)} stages in scope are done (run dir {run_dir}); "
                "use --restart STAGE or --from STAGE to run again",
                markup=False,
                highlight=False,
            )
        for message in ([busy] if busy else []) + _replaced_elsewhere(pipeline, run_dir, to_run, forced):
            log.warning(message)
            console.print(f"[yellow]warning[/] {escape(message)}", highlight=False, soft_wrap=True)
        live = RichDisplay if console.is_terminal else LineDisplay
        with live(console, len(scope)) as display:
            outcome = execute(
                pipeline,
                run_dir,
                scope,
                forced,
                executor=args.executor,
                max_parallel=args.max_parallel,
                ray_address=args.ray_address,
                display=display,
                log=log.info,
            )
        if console.is_terminal:
            console.print(summary_table(pipeline, run_dir, outcome))
        else:
            for line in summary_lines(run_dir, outcome):
                console.print(line, markup=False, highlight=False, soft_wrap=True)
        report = run_dir / REPORT
        if to_run or not report.exists():  # matplotlib costs seconds; a no-op rerun skips it
            blocked = [sid for sid, st in outcome.status.items() if st == "blocked"]
            write_report(pipeline, run_dir, report_statuses(pipeline, run_dir, blocked))
        console.print(
            f"report: {report}   log: {run_dir / RUN_LOG}", markup=False, highlight=False, soft_wrap=True
        )
        for sid, status in outcome.status.items():
            for warning in (
                (read_manifest(run_dir / sid) or {}).get("warnings", []) if status != "skipped" else []
            ):
                console.print(f"[yellow]warning[/] {sid}: {escape(warning)}", highlight=False, soft_wrap=True)
        log.info("run finished: %s", ", ".join(f"{k}={v}" for k, v in outcome.status.items()))
        if outcome.ok:
            restart_finished(run_dir)
        return 0 if outcome.ok else 1
    finally:
        lock.release()


def _replaced_elsewhere(pipeline: Pipeline, run_dir: Path, to_run: list[str], forced: set[str]) -> list[str]:
    """Finished stages this run trains again because another stage file made them with another
    config (two pipelines sharing a run dir and a stage id): their results are about to be replaced,
    which a changed config in the same file means but a second pipeline most likely does not."""
    out = []
    for sid in to_run:
        manifest = read_manifest(run_dir / sid) or {}
        stage = pipeline.stages[sid]
        if (
            sid not in forced
            and manifest.get("status") == "done"
            and manifest.get("file") not in (None, stage.file)
            and manifest.get("config_hash") != stage.config_hash
        ):
            out.append(
                f"stage {sid}: its finished results came from {manifest['file']} with another config; "
                f"this run trains it again from {stage.file} and replaces them (another --run-dir keeps both)"
            )
    return out


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    if not args.run_dir.is_dir():
        raise ConfigError(
            [
                Issue(
                    str(args.run_dir),
                    "is a file, not a run dir" if args.run_dir.exists() else "run dir does not exist",
                    hint="pass the --run-dir of a run (default runs/<stem of the stage file>)",
                )
            ]
        )
    if run := _run_of_stage_dir(args.run_dir):
        raise ConfigError(
            [
                Issue(
                    str(args.run_dir),
                    f"is a stage dir of the run {run}",
                    hint=f"pass the run dir: posttrain status {run}",
                )
            ]
        )
    if not (args.run_dir / PIPELINE).is_file() and not list(args.run_dir.glob("*/manifest.json")):
        raise ConfigError(
            [
                Issue(
                    str(args.run_dir),
                    "holds no run (no pipeline.json, no DIR/<stage>/manifest.json)",
                    hint="pass the --run-dir of a run (default runs/<stem of the stage file>)",
                )
            ]
        )
    table, note = status_table(args.run_dir)
    console.print(table)
    if note:
        console.print(note, markup=False, highlight=False, soft_wrap=True)
    return 0


def _driver_log(run_dir: Path) -> logging.Logger:
    log = logging.getLogger("posttrain.run")
    log.setLevel(logging.INFO)
    log.propagate = False
    for handler in list(log.handlers):
        handler.close()
        log.removeHandler(handler)
    handler = logging.FileHandler(run_dir / RUN_LOG, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s [driver] %(levelname)s %(message)s"))
    log.addHandler(handler)
    return log


def _check_stage_output(source: Path) -> None:
    """Refuse RUN_DIR/STAGE whose model/ its manifest does not vouch for: a stage not `done` (killed
    between publishing model/ and recording it) or a model/ whose files differ from the sha256s the
    manifest recorded. A model dir that is no stage's output is exported as it is."""
    from posttrain.export import ExportError

    manifest = read_manifest(source)
    if manifest is None or not (source / MODEL_DIR).is_dir():
        return
    rerun = f"`posttrain run FILE --restart {source.name}`"
    if manifest.get("status") != "done":
        raise ExportError(
            f"{source}: its manifest says the stage is {manifest.get('status')!r}, not done, so nothing "
            f"vouches for its model/: finish the stage with `posttrain run FILE` (or {rerun})"
        )
    damage = model_damage(source, manifest, full=True)
    if damage:
        raise ExportError(f"{source}: {damage}; train it again with {rerun}")


def cmd_export(args: argparse.Namespace, console: Console) -> int:
    from posttrain.export import ExportError, check_out_dir, export_model

    try:
        check_out_dir(args.out)  # first, as export_model does: before reading the whole model below
        _check_stage_output(args.source)
        result = export_model(args.source, args.fmt, args.out, args.max_shard_size)
    except ExportError as error:
        Console(stderr=True).print(f"posttrain export: {error}", highlight=False, markup=False)
        return 2
    qat = f"QAT {result.qat_scheme}" if result.qat_scheme else "no QAT recorded"
    console.print(f"wrote {args.fmt} ({qat}) to {result.out_dir}: {', '.join(result.files)}", highlight=False)
    return 0


COMMANDS = {
    "run": cmd_run,
    "plan": cmd_plan,
    "status": cmd_status,
    "report": cmd_report,
    "export": cmd_export,
}
# The header over a command's user errors (status and export read no stage file).
ERROR_TITLES = {
    "status": "cannot show the status",
    "report": "cannot write the report",
    "export": "cannot export",
}
# What to do after Ctrl-C or SIGTERM: a run resumes its stages; an export starts over (its --out is
# written beside and renamed into place at the end, so nothing of it is left).
RESUME = "rerun the same command to resume"
AFTER_A_STOP = {
    "export": "nothing was written to --out; rerun the same command to export",
    "report": "rerun the same command to write the report",
}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the driver is so it stops its stages as it does for Ctrl-C."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console()
    errors = Console(stderr=True)
    if argv[:1] == ["--version"]:
        print(f"posttrain {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        stream = sys.stdout if not argv or argv[0] in ("-h", "--help") else sys.stderr
        if argv and argv[0] not in ("-h", "--help"):
            hint = did_you_mean(argv[0], COMMANDS)
            print(f"posttrain: unknown command {argv[0]!r}" + (f"; {hint}" if hint else ""), file=stream)
        print(__doc__, file=stream)
        return 0 if stream is sys.stdout else 2
    try:
        args = _parser(argv[0]).parse_intermixed_args(argv[1:])
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return COMMANDS[argv[0]](args, console)
    except ConfigError as exc:
        print_config_error(errors, exc, ERROR_TITLES.get(argv[0], "invalid stage configuration"))
        return 2
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # The stages were stopped and every record was written atomically: freeing space is all
        # the user has to do.
        hint = "free space (a stage's resume checkpoints: keep_checkpoints), then rerun the same command"
        issue = Issue(exc.filename or "the run dir", exc.strerror or "no space left on device", hint=hint)
        print_config_error(errors, ConfigError([issue]), title="the disk is full")
        return 2
    except Terminated:
        errors.print(f"terminated; {AFTER_A_STOP.get(argv[0], RESUME)}", highlight=False)
        return 143
    except KeyboardInterrupt:
        errors.print(f"interrupted; {AFTER_A_STOP.get(argv[0], RESUME)}", highlight=False)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
