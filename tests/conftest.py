"""Fixtures shared across test packages (keep this file small): one torch thread, the CLI run in
process, the shipped chat renderer, the tiny K3 behind the embedded engine, and stage runs built
the way orchestration.runner builds them. Heavy imports happen inside the fixtures, so test
packages that never use one do not pay for it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from posttrain.data.chat import ChatRenderer
    from posttrain.engines import EmbeddedEngine
    from posttrain.testing import StageRunner


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
    from posttrain.cli import main

    monkeypatch.setenv("COLUMNS", "250")  # rich would otherwise truncate table cells at 80

    def run(*argv: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def renderer() -> ChatRenderer:
    """The K3 chat renderer over the shipped tokenizer. Shared by the whole session: no test may
    change it (or its tokenizer)."""
    from posttrain.data.chat import ChatRenderer, load_tokenizer

    return ChatRenderer(load_tokenizer())


@pytest.fixture(scope="module")
def tiny_k3_engine(renderer: ChatRenderer) -> EmbeddedEngine:
    """The tiny K3 (seed 0, QAT k3 as every stage trains it) behind an EmbeddedEngine. One per test
    module: tests change its weights and policy version, and a module's tests may rely on that."""
    from posttrain.engines import EmbeddedEngine
    from posttrain.engines.testing import tiny_k3
    from posttrain.qat import QATConfig

    return EmbeddedEngine(tiny_k3(0, qat=QATConfig(scheme="k3")), pad_token_id=renderer.pad_id)


@pytest.fixture(scope="session")
def stage_runner() -> StageRunner:
    """Registered stage kinds run in this process on contexts built as orchestration.runner builds
    them (posttrain.testing, shared with plug-in authors' tests)."""
    from posttrain.testing import StageRunner

    return StageRunner()
