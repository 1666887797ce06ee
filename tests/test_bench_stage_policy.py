"""bench/stage_policy.py, the setup the evaluation benches share: the harness it reads is the RL
stages' own (stages/rl.yaml), and a bench built on it plays a model's held-out episodes end to end."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import yaml

from posttrain.envs.environments import EnvironmentConfig

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("stage_policy", REPO / "bench" / "stage_policy.py")
stage_policy = importlib.util.module_from_spec(_spec)
sys.modules["stage_policy"] = stage_policy  # dataclasses resolve their module by name
_spec.loader.exec_module(stage_policy)


def test_rl_harness_is_the_rl_stages_and_narrows_to_the_families_asked() -> None:
    shipped = yaml.safe_load((REPO / "stages" / "rl.yaml").read_text())["environments"]
    for domain in ("general", "agent", "coding"):
        config = stage_policy.rl_harness(domain)
        assert config == EnvironmentConfig(**shipped[domain]), domain
        assert config.families == []
    narrowed = stage_policy.rl_harness("agent", ["agent/order_cost"])
    assert narrowed.families == ["agent/order_cost"]
    assert narrowed.max_turns == shipped["agent"]["max_turns"]


def test_a_bench_on_it_plays_held_out_episodes_of_a_model() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "family_episodes.py"),
            str(REPO / "data_recipes" / "base"),
            "general/arithmetic",
            "--prompts",
            "2",
            "--tail",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    solved = re.search(r"general/arithmetic at high, temperature 0\.0: solved (\d+)/(\d+)", out)
    assert solved, out
    assert int(solved.group(2)) == 2 and int(solved.group(1)) <= 2
    routes = re.findall(r"calls (.+): (\d+) episodes, (\d+) solved", out)
    assert sum(int(n) for _, n, _ in routes) == 2, out
