"""Fixtures shared across test packages (keep this file small)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread for the whole suite, module-scoped model fixtures included: the
    models are tiny, the machine has 2 shared cores, and extra threads only add contention
    (a decode step measured 0.9 s with 2 threads against 24-33 ms with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
