"""Shipped task families for the default run (general, agent, coding) and their real tools.

Importing this package registers the families in posttrain.envs.tasks.TASK_FAMILIES. FAMILIES are
the default run's; the visual families (general/visual, general/visual_cost: images) are
registered too but opt-in.
"""

from data_recipes.agent_tasks import (
    agent,
    coding,
    general,
    visual,  # noqa: F401  (registers the opt-in image families)
)

FAMILIES: tuple[str, ...] = (
    general.Arithmetic.name,
    general.UnitConvert.name,  # in general/elements' place (issue #21)
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
    # coding's second and third route choices (issue #21), after the 2160 rows they join
    coding.UnitConvert.name,
    coding.Arithmetic.name,
)

__all__ = ["FAMILIES"]
