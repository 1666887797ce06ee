"""The sandbox pool RL episodes borrow from: a sandbox whose start fails for a moment is started
again (the stage goes on, the retry counted), one that never starts is an error naming how often it
was tried. The failing starts are injected (`FlakyStartSandbox`); the sandbox that finally starts is
a real one."""

from __future__ import annotations

import pytest

from posttrain.envs import env_sandboxes
from posttrain.envs.env_sandboxes import START_ATTEMPTS, SandboxPool
from posttrain.envs.sandbox import Sandbox, SandboxError


def flaky_start_sandbox(failures: int) -> type:
    """A Sandbox class whose first `failures` starts raise as a pid 1 that died during start does."""

    class FlakyStartSandbox(Sandbox):
        starts = 0

        def __init__(self, **kwargs):
            type(self).starts += 1
            if type(self).starts <= failures:
                raise SandboxError("sandbox sb-test: pid 1 exited during 'start' (injected)")
            super().__init__(**kwargs)

    return FlakyStartSandbox


def test_a_failed_start_is_retried_and_counted(tmp_path, monkeypatch):
    flaky = flaky_start_sandbox(START_ATTEMPTS - 1)
    monkeypatch.setattr(env_sandboxes, "Sandbox", flaky)
    monkeypatch.setattr(env_sandboxes, "START_RETRY_PAUSE_S", 0.0)
    pool = SandboxPool(tmp_path, memory_mb=256, cpu_seconds=10, max_processes=32, network=False)
    try:
        sandbox = pool.acquire()
        assert sandbox.run("echo ok > /workspace/f && cat /workspace/f").stdout == "ok\n"
        assert (flaky.starts, pool.start_retries, pool.created) == (START_ATTEMPTS, START_ATTEMPTS - 1, 1)
        pool.release(sandbox)
    finally:
        pool.close()


def test_a_start_that_always_fails_is_an_error_after_every_attempt(tmp_path, monkeypatch):
    flaky = flaky_start_sandbox(START_ATTEMPTS)
    monkeypatch.setattr(env_sandboxes, "Sandbox", flaky)
    monkeypatch.setattr(env_sandboxes, "START_RETRY_PAUSE_S", 0.0)
    pool = SandboxPool(tmp_path, memory_mb=256, cpu_seconds=10, max_processes=32, network=False)
    with pytest.raises(SandboxError, match=f"exited during 'start'.*failed {START_ATTEMPTS} times in a row"):
        pool.acquire()
    assert flaky.starts == START_ATTEMPTS and pool.created == 0 and pool.lent == 0
