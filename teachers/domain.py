"""Registering a teacher domain: `@teacher_domain` on the domain's environment class.

A teacher domain is what MOPD needs to distil a domain: an environment (posttrain.envs.environments:
its task families are the prompt recipe and verifier, its tools run in its sandboxes) and a teacher
for each reasoning effort. Entries land in posttrain.trainers.mopd_teachers.TEACHER_DOMAINS, where
the `mopd` stage looks them up by the names listed under `domains:`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from posttrain.data.sample import EFFORTS
from posttrain.envs.environments import Environment
from posttrain.trainers.mopd_teachers import TEACHER_DOMAINS


@dataclass(frozen=True)
class TeacherDomain:
    """name; environment: the Environment subclass playing its episodes; teachers: effort -> a
    need's stage id or a model dir."""

    name: str
    environment: type[Environment]
    teachers: Mapping[str, str]


def teacher_domain(
    name: str | None = None, *, teachers: Mapping[str, str] | None = None
) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator registering an Environment subclass as teacher domain `name` (default: its
    `domain`). teachers: effort -> a need's stage id or a model dir; default rl-<name>-<effort> for
    every effort, the stage ids of the RL specialists an `rl` matrix over the domain produces."""

    def register(environment: type[Environment]) -> type[Environment]:
        domain = name or environment.domain
        if environment.domain != domain:
            raise ValueError(
                f"teacher domain {domain!r}: {environment.__name__}.domain is {environment.domain!r}; "
                "its prompts carry that domain, so the two names must be equal"
            )
        chosen = dict(teachers) if teachers is not None else {e: f"rl-{domain}-{e}" for e in EFFORTS}
        unknown = sorted(set(chosen) - set(EFFORTS))
        if unknown:
            raise ValueError(f"teacher domain {domain!r}: unknown efforts {unknown}; use {list(EFFORTS)}")
        TEACHER_DOMAINS.register(domain)(TeacherDomain(domain, environment, chosen))
        return environment

    return register
