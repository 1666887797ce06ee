"""The user plug-in path: a third party's package, installed with a `posttrain.plugins` entry point,
registers a stage kind that a stage file names without any `plugins:` key, and `posttrain run` (its
own process, stage processes forked from the preloaded server) runs it. Without the entry point the
same file names an unknown kind: the entry point, not the import path, does the work. posttrain's
own packages are plain imports (tests/test_architecture.py). A stage file's plug-in files are each
imported, whatever their names, and a file whose import failed (even after it registered something)
is imported again once fixed. And the registry's own contract: a taken name is an error naming both
entries, and a tool or task family is registered under its own name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestration.pipeline import load_pipeline
from posttrain.envs.tasks import TASK_FAMILIES, TaskFamily
from posttrain.envs.tools import TOOLS, Tool
from posttrain.registry import Registry, RegistryError, import_plugin
from posttrain.stages import STAGE_KINDS

REPO = Path(__file__).resolve().parents[1]

PLUGIN = '''
from pydantic import BaseModel, ConfigDict

from posttrain.stages import StageContext, stage_kind


class Echo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: int = 1


@stage_kind("acme-echo", config=Echo)
def run_echo(ctx: StageContext) -> dict[str, float]:
    """Write `value` to the stage's output."""
    (ctx.output_dir / "value.txt").write_text(str(ctx.config.value))
    return {"value": float(ctx.config.value)}
'''


def install_acme(site: Path, entry_point: bool) -> None:
    """The files `pip install acme-stages` would put in a site directory: the package and its
    dist-info, with the entry point when `entry_point`."""
    (site / "acme_stages").mkdir(parents=True)
    (site / "acme_stages" / "__init__.py").write_text(PLUGIN)
    info = site / "acme_stages-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-stages\nVersion: 1.0\n")
    if entry_point:
        (info / "entry_points.txt").write_text("[posttrain.plugins]\nacme = acme_stages\n")


def posttrain(site: Path, cwd: Path, *argv: object) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}", OMP_NUM_THREADS="1", COLUMNS="250")
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *map(str, argv)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_third_party_entry_point_registers_a_stage_kind_that_runs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install_acme(site, entry_point=True)
    stage = tmp_path / "a.yaml"
    stage.write_text("kind: acme-echo\nvalue: 7\n")
    done = posttrain(site, tmp_path, "run", stage, "--run-dir", tmp_path / "run")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "run" / "a" / "model" / "value.txt").read_text() == "7"


def test_without_the_entry_point_the_kind_is_unknown(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install_acme(site, entry_point=False)
    stage = tmp_path / "a.yaml"
    stage.write_text("kind: acme-echo\nvalue: 7\n")
    planned = posttrain(site, tmp_path, "plan", stage)
    assert "a.yaml:1: kind: kind 'acme-echo' is not registered" in planned.stdout, planned.stderr
    done = posttrain(site, tmp_path, "run", stage, "--run-dir", tmp_path / "run")
    assert done.returncode != 0 and not (tmp_path / "run" / "a" / "model").exists()


def kind_plugin(path: Path, kind: str) -> Path:
    """A plug-in file at `path` registering the stage kind `kind`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"from posttrain.stages import stage_kind\n\nstage_kind({kind!r})(lambda ctx: {{}})\n")
    return path


def test_plugin_files_of_the_same_name_in_two_folders_are_both_imported(tmp_path: Path) -> None:
    kind_plugin(tmp_path / "a" / "domain.py", "same-file-name-a")
    kind_plugin(tmp_path / "b" / "domain.py", "same-file-name-b")
    stage = tmp_path / "b.yaml"
    stage.write_text("kind: same-file-name-b\nplugins: [a/domain.py, b/domain.py]\n")
    assert load_pipeline(stage).stages["b"].registered
    assert {"same-file-name-a", "same-file-name-b"} <= set(STAGE_KINDS)
    import_plugin(str(tmp_path / "a" / ".." / "b" / "domain.py"))  # the same file again: no-op


def test_a_plugin_file_that_failed_to_import_is_imported_again_once_fixed(tmp_path: Path) -> None:
    path = tmp_path / "kinds.py"
    path.write_text("raise RuntimeError('a typo in the plug-in')\n")
    with pytest.raises(RuntimeError, match="a typo in the plug-in"):
        import_plugin(str(path))
    kind_plugin(path, "fixed-after-a-failed-import")
    import_plugin(str(path))
    assert "fixed-after-a-failed-import" in STAGE_KINDS

    # Failed after registering: what it registered is taken back with it. Before, the fixed file's
    # retry in the same process was refused: "stage kind ... is registered twice".
    half = tmp_path / "half.py"
    kind_plugin(half, "registered-before-a-failure")
    half.write_text(half.read_text() + "\nraise RuntimeError('a typo after the registration')\n")
    with pytest.raises(RuntimeError, match="a typo after the registration"):
        import_plugin(str(half))
    assert "registered-before-a-failure" not in STAGE_KINDS
    kind_plugin(half, "registered-before-a-failure")
    import_plugin(str(half))
    assert STAGE_KINDS.get("registered-before-a-failure").run.__module__.startswith(
        "posttrain_user_plugin_half_"
    )


def test_a_registry_rejects_a_second_entry_under_a_taken_name() -> None:
    things: Registry[object] = Registry("thing")
    first = things.register("a")(type("First", (), {}))
    assert things.register("a")(first) is first  # the same object again is no conflict
    with pytest.raises(RegistryError, match=r"thing 'a' is registered twice \(first by .*First, again by"):
        things.register("a")(type("Second", (), {}))
    with pytest.raises(RegistryError, match=r"unknown thing 'b' \(registered: a\)"):
        things.get("b")


def test_tools_and_task_families_are_registered_under_their_own_name() -> None:
    # The model calls a tool by its `name` and a prompt names its family by the family's: another
    # registry key would make every demonstrated call undeclared, every prompt's family unknown.
    echo = type("Echo", (Tool,), {"name": "echo"})
    with pytest.raises(
        RegistryError,
        match=r"tool 'echo_tool' is registered under another name than its own: .*Echo.name is 'echo'; "
        r"register it as 'echo' or set name = 'echo_tool'",
    ):
        TOOLS.register("echo_tool")(echo)
    family = type("Sum", (TaskFamily,), {"name": "math/other_name"})
    with pytest.raises(RegistryError, match=r"task family 'math/add' is registered under another name"):
        TASK_FAMILIES.register("math/add")(family)
    assert "echo_tool" not in TOOLS and "math/add" not in TASK_FAMILIES
