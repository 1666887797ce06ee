"""The shipped data recipes (registered in posttrain.data.mixture.DATA_RECIPES).

agent_sft: the default run's SFT data, every shipped trajectory once (all three domains), with 5%
held out for eval loss and tool-task success. agent_sft_agentic: the same trajectories with the
multi-turn agent domain weighted twice, an example of a weighted mixture.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.data.mixture import DATA_RECIPES, MixtureSource, Recipe

SHIPPED_SFT = str(Path(__file__).resolve().parent / "data" / "agent_sft.jsonl")


@DATA_RECIPES.register("agent_sft")
def agent_sft() -> Recipe:
    return Recipe(
        sources=(MixtureSource(SHIPPED_SFT),), eval_fraction=0.05, description="shipped agent SFT set"
    )


@DATA_RECIPES.register("agent_sft_agentic")
def agent_sft_agentic() -> Recipe:
    return Recipe(
        sources=(
            MixtureSource(SHIPPED_SFT, weight=1.0, domains=("general", "coding")),
            MixtureSource(SHIPPED_SFT, weight=2.0, domains=("agent",)),
        ),
        eval_fraction=0.05,
        description="shipped agent SFT set, agent domain twice",
    )
