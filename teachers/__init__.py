"""Teacher domains and backends for MOPD: (domain, effort) -> a teacher model dir + an engine.

Importing the package registers, in posttrain.trainers.mopd's registries, the shipped domains
(general, agent, coding: each taught at every effort by its RL specialist rl-<domain>-<effort>)
and the teacher backends (embedded, vllm, vllm_server). A custom domain registers the same way
from a user's own package or a .py file listed under `plugins:`; teachers/examples/math.py is a
worked one.
"""

from posttrain.trainers.mopd import TEACHER_BACKENDS, TEACHER_DOMAINS, TeacherDomain, teacher_domain
from teachers import backends, domains

__all__ = ["TEACHER_BACKENDS", "TEACHER_DOMAINS", "TeacherDomain", "backends", "domains", "teacher_domain"]
