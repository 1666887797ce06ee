"""Loading a K3 directory holds about one copy of the weights: `from_pretrained` builds the model on
the meta device and streams tensors from the shards (`load_memory_check.py` measures anonymous
memory in a fresh process). The naive twin (random init, then a whole state dict) is measured the
same way and needs two copies, so the bound is one the measurement can tell apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("load_memory_check.py")
REPO = Path(__file__).resolve().parents[2]


def measure(model_dir: Path, how: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(CHECK), str(model_dir), how],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def wide_k3_dir(tmp_path_factory) -> Path:
    """A released-layout K3 of about 250 MB (fp32, wide routed experts), in 64 MB shards."""
    from posttrain.engines.testing import TINY_K3_PRESET
    from posttrain.model import KimiK3ForCausalLM, load_model_config, save_released

    config = load_model_config(TINY_K3_PRESET)
    config.hidden_size, config.routed_expert_hidden_size = 256, 256
    config.num_experts, config.moe_intermediate_size = 64, 512
    directory = tmp_path_factory.mktemp("wide") / "k3"
    return save_released(KimiK3ForCausalLM(config), directory, max_shard_size="64MB")


def test_from_pretrained_holds_about_one_copy_of_the_weights(wide_k3_dir):
    streamed = measure(wide_k3_dir, "streamed")
    naive = measure(wide_k3_dir, "naive")
    weights = streamed["param_bytes"]
    assert weights > 200 * 2**20 and len(list(wide_k3_dir.glob("*.safetensors"))) > 2
    assert streamed["peak_delta"] < 1.35 * weights, streamed
    assert naive["peak_delta"] > 1.8 * weights, naive  # the measurement sees a second copy
