"""Dataset recipes (the `datasets` library), shipped small data and trajectory generators.

Importing the package registers the shipped data recipes (posttrain.data.mixture.DATA_RECIPES) and
task families (posttrain.envs.tasks.TASK_FAMILIES).
"""

from data_recipes import agent_tasks, recipes

__all__ = ["agent_tasks", "recipes"]
