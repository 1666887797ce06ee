"""Shipped task families for the default run (general, agent, coding) and their real tools.

Importing this package registers the families in posttrain.envs.tasks.TASK_FAMILIES. FAMILIES are
the default run's; `visual.VisualQuestions` (general/visual, images) is registered too but opt-in.
"""

from data_recipes.agent_tasks import agent, coding, general, visual

FAMILIES: tuple[str, ...] = (
    general.Arithmetic.name,
    general.Elements.name,
    general.Ordering.name,
    general.Lookup.name,
    agent.OrderTotal.name,
    agent.StaffOffice.name,
    agent.DesksPerFloor.name,
    coding.WriteFunction.name,
    coding.FixFunction.name,
    # last, so the shipped file's first 1800 rows stay those of the nine families before them
    agent.OrderCost.name,
    general.UnitCost.name,
    coding.CrateCost.name,
)

VISUAL_FAMILIES: tuple[str, ...] = (visual.VisualQuestions.name,)

__all__ = ["FAMILIES", "VISUAL_FAMILIES"]
