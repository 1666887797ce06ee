"""The vision option's stage files (stages/vision/) load as one pipeline whose kinds accept every
key: sft with the pre-aligned vision tower and the visual recipe, the general specialists offering the visual
family, and the distillation of those three into the multimodal student."""

from __future__ import annotations

from pathlib import Path

import data_recipes  # noqa: F401  (registers the recipes and families the files name)
from orchestration.pipeline import load_pipeline
from posttrain.stages import STAGE_KINDS

VISION = Path(__file__).resolve().parents[2] / "stages" / "vision"


def test_the_vision_pipeline_loads_and_validates():
    pipeline = load_pipeline(VISION / "mopd.yaml")
    assert list(pipeline.stages) == ["sft", "rl-general-low", "rl-general-high", "rl-general-max", "mopd"]
    sft = STAGE_KINDS.get("sft").config.model_validate(pipeline.stages["sft"].body)
    assert sft.vision == "../data_recipes/vision_base"  # the pre-aligned tower
    assert set(sft.data.recipes) == {"agent_sft", "visual_sft"}
    for effort in ("low", "high", "max"):
        stage = pipeline.stages[f"rl-general-{effort}"]
        rl = STAGE_KINDS.get("rl").config.model_validate(stage.body)
        families = rl.environments["general"].families
        assert {"general/visual", "general/visual_cost"} <= set(families) and stage.needs == ["sft"]
        # the visual questions' own evaluation, large enough to tell a change (issue #22's claim)
        assert rl.eval.subsets["visual"].families == ["general/visual", "general/visual_cost"]
        assert (
            rl.eval.prompts == 96
            and rl.eval.subsets["visual"].prompts * rl.eval.subsets["visual"].samples_per_prompt == 600
        )
    mopd = pipeline.stages["mopd"]
    assert sorted(mopd.needs) == ["rl-general-high", "rl-general-low", "rl-general-max", "sft"]
    assert mopd.body["environments"]["general"]["families"] == families  # taught where its teachers were
