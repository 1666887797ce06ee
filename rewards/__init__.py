"""Reward plug-ins: the budget reward and the length-capped GenRM.

Importing the package registers every reward in posttrain.rewards_registry.REWARDS (the engine
imports it through the `posttrain.plugins` entry points, never by name). The MOPD log-ratio reward
is not a plug-in: it is a pure tensor function of the engine (posttrain.algos.mopd_reward).
"""

from rewards import budget, genrm  # noqa: F401  (imported to register)
