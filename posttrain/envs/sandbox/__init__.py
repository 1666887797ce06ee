"""Persistent agent sandboxes: isolated, pausable, forkable, snapshotted (see docs/sandbox.md)."""

from posttrain.envs.sandbox.sandbox import RunResult, Sandbox, SandboxError

__all__ = ["RunResult", "Sandbox", "SandboxError"]
