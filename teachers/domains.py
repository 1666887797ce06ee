"""The shipped teacher domains: general, agent and coding, each played in the RL stage's own
environment and taught at every effort by its RL specialist (rl-<domain>-<effort>).

MOPD reuses the RL environments unchanged, so the student is distilled on the same prompt
families, tools and verifiers its teachers were trained on.
"""

from posttrain.envs.environments import AgentEnvironment, CodingEnvironment, GeneralEnvironment
from posttrain.trainers.mopd_teachers import teacher_domain

for _environment in (GeneralEnvironment, AgentEnvironment, CodingEnvironment):
    teacher_domain()(_environment)
