"""Fixtures shared across test packages (keep this file small)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def posttrain(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple]:
    """posttrain("plan", path, ...) -> (exit code, stdout, stderr): the CLI run in this process."""
    from posttrain.cli import main  # imported here so test packages that never use it do not pay

    monkeypatch.setenv("COLUMNS", "250")  # rich would otherwise truncate table cells at 80

    def run(*argv: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run
