"""A custom domain whose plug-in registers fewer teachers than the efforts trained: the error
names every missing pair at once and says where the `teachers:` key goes (it is not in the
shipped stage file until a user adds it)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from posttrain.envs.environments import Environment
from posttrain.trainers.mopd import MOPDConfig
from posttrain.trainers.mopd_teachers import teacher_domain


@teacher_domain("missing-two", teachers={"low": "rl-missing-two-low"})
class LowOnlyEnvironment(Environment):
    """A domain whose plug-in registers a teacher for low effort only."""

    domain = "missing-two"


def test_every_missing_pair_is_named_with_where_the_fix_goes() -> None:
    with pytest.raises(ValidationError) as error:
        MOPDConfig.model_validate({"train": {"steps": 1}, "domains": ["missing-two"]})
    message = str(error.value)
    assert (
        "no teacher for (domain 'missing-two', effort 'high'), (domain 'missing-two', effort 'max')"
        in message
    )
    assert "teachers: {missing-two-high: {model: " in message and "missing-two-max: {model: " in message
    assert "a top-level key of the mopd stage file" in message
    assert "remove 'high', 'max' from `efforts`" in message


def test_an_rl_stage_of_a_new_domain_without_budget_usage_fails_at_plan(tmp_path, posttrain) -> None:
    """Found when the stage files are read, not after three RL stages failed at run time."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    shipped = (repo / "stages" / "rl.yaml").read_text()
    stage = tmp_path / "rl.yaml"
    # a domain whose environment a plug-in registers (an unregistered one is refused before this)
    stage.write_text(
        shipped.replace("needs: [sft.yaml]\n", f"plugins: ['{repo / 'examples' / 'math_domain.py'}']\n")
        .replace("domain: [general, agent, coding]", "domain: [math]")
        .replace("init: sft ", "init: /nowhere ")
    )
    code, out, err = posttrain("plan", stage)
    assert code == 2
    assert "domain 'math' has no budget usage counting" in err
    assert "budget: {usage: {math: thinking}}" in err
