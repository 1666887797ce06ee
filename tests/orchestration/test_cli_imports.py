"""The command line reads no model: `posttrain --help`, `status` and the run report (written by
the driver at the end of every `posttrain run`) import neither torch nor transformers, which take
seconds to import (bench/RESULTS.md, "The command line's start"); the stages, which need them,
import them in their own processes (the fork server's preload). Validating a stage file imports
the stage kinds' modules, but not `datasets` until a stage loads data."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "vllm")


def loaded_after(imports: str, watched: tuple[str, ...]) -> list[str]:
    """Which of `watched` a fresh interpreter has imported after `import <imports>`."""
    found = f"[m for m in {watched!r} if m in sys.modules]"
    code = f"import json, sys\nimport {imports}\nprint(json.dumps({found}))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_cli_and_the_run_report_import_no_model_stack():
    imports = "posttrain.cli, orchestration.report, orchestration.outcomes, posttrain.stats"
    assert loaded_after(imports, HEAVY) == []


def test_the_stage_kinds_and_shipped_recipes_import_no_data_library():
    assert loaded_after("posttrain.trainers, data_recipes", ("datasets",)) == []
