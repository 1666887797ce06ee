"""Teacher domains and backends for MOPD: (domain, effort) -> a teacher model dir + an engine.

Importing the package registers, in posttrain.trainers.mopd_teachers' registries, the shipped
domains (general, agent, coding: each taught at every effort by its RL specialist
rl-<domain>-<effort>) and the teacher backends (embedded, vllm, vllm_server). A custom domain
registers the same way from a user's own package or a .py file listed under `plugins:`;
teachers/examples/math.py is a worked one.
"""

from teachers import backends, domains
from teachers.domain import TeacherDomain, teacher_domain

__all__ = ["TeacherDomain", "backends", "domains", "teacher_domain"]
