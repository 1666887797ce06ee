"""Fixtures for the orchestration tests: stage files in a temp dir, and the CLI run in-process
(fast, for errors and plans) or as a real subprocess (for kills and Ray)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from orchestration_support import TOY_STAGES, TOY_TRAINING

from posttrain.cli import main


@pytest.fixture
def write(tmp_path: Path) -> Callable[..., Path]:
    """write("a.yaml", *parts) -> path: each part dedented, joined; `{toy}` / `{train}` become the
    plug-in paths."""

    def write_file(name: str, *parts: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(textwrap.dedent(part).lstrip("\n") for part in parts)
        path.write_text(text.replace("{toy}", str(TOY_STAGES)).replace("{train}", str(TOY_TRAINING)))
        return path

    return write_file


@pytest.fixture
def posttrain(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple]:
    """posttrain("plan", path, ...) -> (exit code, stdout, stderr), run in this process."""
    monkeypatch.setenv("COLUMNS", "250")  # rich would otherwise truncate table cells at 80

    def run(*argv: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run
