"""The reward registry: the name a stage file writes (`reward: budget`, `verifier: exact_match`)
-> the reward's entry point, so trainers look rewards up without importing this package by name.

An entry is a callable (a function or a class); its docstring states its inputs and output. The
modules that register live beside this one and must be imported for their entries to exist, which
`rewards/__init__.py` does for the built-in ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from posttrain.registry import Registry

REWARDS: Registry[Callable[..., Any]] = Registry("reward")
