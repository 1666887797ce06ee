"""The shipped data recipes (registered in posttrain.data.mixture.DATA_RECIPES).

agent_sft: the default run's SFT data, every shipped trajectory once (all three domains, 2400 rows),
with 5% held out for eval loss and tool-task success. agent_sft_agentic: the same trajectories with the
multi-turn agent domain weighted twice, an example of a weighted mixture. visual_sft: the
general/visual questions (images drawn with Pillow from each prompt's seed, nothing downloaded),
demonstrated and written to a local file on every call (a pure function of the seed), for a stage
with a vision tower (stages/vision/).
"""

from __future__ import annotations

import os
import tempfile
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


# Drawn visual trajectories: with the pre-aligned tower kept fixed, the text model learns to read
# it from 1500-2000 visual documents (bench/RESULTS.md); 720 rows give about 1500 in the vision
# SFT's 1200 steps (240 gave about 600, and it read only the digits); 1440 give about 2400 (1.78
# epochs) and answer more new drawn questions: greedy 0.500 -> 0.605 on 600 (issue #22).
VISUAL_SFT_ROWS = 1440
# general/visual_cost's route-choice rows (half each route), as many as a text route family's
VISUAL_COST_SFT_ROWS = 240


def write_visual_sft(
    out: Path, rows: int = VISUAL_SFT_ROWS, cost_rows: int = VISUAL_COST_SFT_ROWS, seed: int = 0
) -> Path:
    """Write `rows` demonstrated general/visual trajectories and `cost_rows` general/visual_cost
    ones (byte-identical for a seed) to `out`, through a temporary file renamed into place, so
    concurrent stages never read half a file."""
    from data_recipes.agent_tasks import visual
    from data_recipes.agent_tasks.generate import generate_trajectory, to_jsonl

    counts = {visual.VisualQuestions.name: rows, visual.VisualCost.name: cost_rows}
    records = [generate_trajectory(name, index, seed) for name, n in counts.items() for index in range(n)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    tmp.write_text(to_jsonl(records))
    tmp.replace(out)
    return out


@DATA_RECIPES.register("visual_sft")
def visual_sft() -> Recipe:
    # the row count in the name: runs of another version of this file never read each other's rows
    name = f"visual_sft-{VISUAL_SFT_ROWS}-{VISUAL_COST_SFT_ROWS}.jsonl"
    path = write_visual_sft(Path(tempfile.gettempdir()) / "posttrain-recipes" / name)
    return Recipe(
        sources=(MixtureSource(str(path)),), eval_fraction=0.05, description="drawn visual questions"
    )
