"""Loading a K3 directory holds about one copy of the weights: `from_pretrained` builds the model on
the meta device and streams tensors from the shards (`load_memory_check.py` measures anonymous
memory in a fresh process). The naive twin (random init, then a whole state dict) is measured the
same way and needs two copies, so the bound is one the measurement can tell apart."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_result import script_result

CHECK = Path(__file__).with_name("load_memory_check.py")


def measure(model_dir: Path, how: str) -> dict:
    return script_result(CHECK, str(model_dir), how)


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
