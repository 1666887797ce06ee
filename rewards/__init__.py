"""Reward plug-ins: budget reward, length-capped GenRM, verifiers, MOPD log-ratio reward.

Importing the package registers every reward in `rewards.registry.REWARDS`.
"""

from rewards import budget, genrm, mopd, verifiers  # noqa: F401  (imported to register)
