"""Teacher domains for MOPD: (domain, effort) -> a teacher model dir (its engine is any
posttrain.engines name, built by posttrain.engines.build.build_engine).

Importing the package registers, in posttrain.trainers.mopd_teachers.TEACHER_DOMAINS, the shipped
domains (general, agent, coding: each taught at every effort by its RL specialist
rl-<domain>-<effort>). A custom domain
registers the same way from a user's own package or a .py file listed under `plugins:`;
teachers/examples/math.py is a worked one.
"""

from posttrain.trainers.mopd_teachers import TeacherDomain, teacher_domain
from teachers import domains

__all__ = ["TeacherDomain", "domains", "teacher_domain"]
