"""MoonViT-V2: the config against vLLM's, the released size on the meta device, patch and merge
shapes, and the tower's fast paths against their naive twins (forward and every gradient)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch
import yaml
from vision_fixtures import VISION_YAML, tiny_vl_model

from posttrain.model import count_parameters, load_model_config
from posttrain.model.vision import MoonViTPatchEmbed, MoonViTV2, packed_attention, patch_merge
from posttrain.model.vision_config import KimiK3VisionConfig, load_vision_config
from posttrain.model.vision_model import (
    KimiK3ForConditionalGeneration,
    KimiK3VLConfig,
    count_vision_parameters,
)
from posttrain.model.vision_naive import naive_packed_attention, naive_patch_embed, naive_patch_merge

REPO = Path(__file__).resolve().parents[2]
FULL_VISION_YAML = REPO / "stages" / "models" / "vision-full.yaml"


def vllm_vision_config_defaults() -> dict[str, object]:
    """Argument names and defaults of vLLM's KimiK3VisionConfig, read from the installed wheel's source."""
    root = Path(importlib.util.find_spec("vllm").origin).parent
    tree = ast.parse((root / "transformers_utils" / "configs" / "kimi_k3.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KimiK3VisionConfig")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[1:]
    defaults = [ast.literal_eval(d) for d in init.args.defaults]
    return dict(zip([a.arg for a in args], defaults, strict=True))


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def test_config_keys_and_defaults_are_vllms():
    theirs = vllm_vision_config_defaults()
    ours = KimiK3VisionConfig()
    # _attn_implementation is transformers' own attribute; ours adds initializer_range
    assert set(theirs) - {"_attn_implementation"} <= set(ours.to_dict())
    for key, default in theirs.items():
        if key == "_attn_implementation":
            continue
        value = getattr(ours, key)
        if key == "mm_hidden_size":  # None there means vt_hidden_size, resolved here at construction
            assert default is None and value == ours.vt_hidden_size
            continue
        assert (list(value) if isinstance(value, list | tuple) else value) == (
            list(default) if isinstance(default, tuple) else default
        ), key
    # the full preset is exactly the released defaults, the tiny one uses only known keys
    assert load_vision_config(FULL_VISION_YAML, text_hidden_size=2304).to_dict() == ours.to_dict()
    tiny = load_vision_config(VISION_YAML, text_hidden_size=64)
    assert set(yaml.safe_load(VISION_YAML.read_text())) <= set(theirs)
    assert (tiny.vt_num_hidden_layers, tiny.vt_hidden_size, tiny.text_hidden_size) == (2, 32, 64)


def test_released_size_builds_on_meta_and_counts_beside_the_text_totals():
    vision = load_vision_config(FULL_VISION_YAML)
    counts = count_vision_parameters(vision)
    # MoonViT-V2 is published at about 401M parameters (27 layers)
    assert counts["vision_tower"] == 401_214_464
    assert abs(counts["vision_tower"] - 401e6) / 401e6 < 1e-3
    text = load_model_config(REPO / "stages" / "models" / "k3-full.yaml")
    config = KimiK3VLConfig(text_config=text, vision_config=vision)
    assert config.vision_config.text_hidden_size == 7168
    # 4 x 1024 -> 4096 -> 7168 and the 7168-wide post-norm
    assert count_vision_parameters(config)["mm_projector"] == 4096 * 4096 + 4096 * 7168 + 7168
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config)
    total = sum(p.numel() for p in model.parameters())
    text_total = count_parameters(text)["total"]
    assert text_total == 2_779_484_393_568
    assert total == text_total + counts["vision_tower"] + 4096 * 4096 + 4096 * 7168 + 7168
    assert len(model.vision_tower.encoder.blocks) == 27


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 6, 10)],  # one image, 60 patches
        [(1, 2, 2), (3, 4, 2), (1, 8, 6)],  # a small image, a 3-frame chunk, a tall image
    ],
)
def test_tower_forward_and_gradients_match_the_naive_attention(grids):
    torch.manual_seed(0)
    model = tiny_vl_model(seed=1)
    tower = model.vision_tower.double()
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, 3, 14, 14, dtype=torch.float64, requires_grad=True)
    outputs = {}
    for name, attention in (("fast", packed_attention), ("naive", naive_packed_attention)):
        tower.zero_grad()
        pixels.grad = None
        out = tower(pixels, grids, attention=attention)
        weight = torch.randn_like(out, generator=torch.Generator().manual_seed(2))
        (out * weight).sum().backward()
        grads = {k: p.grad.clone() for k, p in tower.named_parameters()}
        outputs[name] = (out.detach(), pixels.grad.clone(), grads)
    (out_f, gx_f, g_f), (out_n, gx_n, g_n) = outputs["fast"], outputs["naive"]
    assert out_f.shape == (sum(h * w // 4 for _, h, w in grids), 4, 32)
    assert rel_rms(out_f, out_n) < 1e-10
    assert rel_rms(gx_f, gx_n) < 1e-10
    assert set(g_f) == set(g_n)
    for key in g_f:
        assert g_n[key].abs().sum() > 0, key  # every parameter gets a gradient
        assert rel_rms(g_f[key], g_n[key]) < 1e-10, key


def test_attention_stays_inside_each_item():
    torch.manual_seed(0)
    q, k, v = (torch.randn(10, 2, 8, dtype=torch.float64) for _ in range(3))
    cu = [0, 4, 10]
    out = packed_attention(q, k, v, cu, 8**-0.5)
    v2 = v.clone()
    v2[4:] += 1.0  # changing the second item's values leaves the first item's outputs alone
    out2 = packed_attention(q, k, v2, cu, 8**-0.5)
    assert torch.equal(out[:4], out2[:4]) and not torch.allclose(out[4:], out2[4:])
    assert rel_rms(out, naive_packed_attention(q, k, v, cu, 8**-0.5)) < 1e-12


def test_patch_embed_is_the_stride_14_convolution_of_the_frame_forward_and_backward():
    config = load_vision_config(VISION_YAML)
    config.patch_embed_proj_bias = True
    torch.manual_seed(0)
    embed = MoonViTPatchEmbed(config).double()
    with torch.no_grad():
        embed.proj.weight.normal_()
        embed.proj.bias.normal_()
        embed.pos_emb.weight.zero_()  # the projection alone
    frame = torch.randn(3, 56, 84, dtype=torch.float64, requires_grad=True)  # 4 x 6 patches
    # cut as the processor cuts: patch (r, c) = frame[:, 14r:14r+14, 14c:14c+14], raster order
    patches = frame.view(3, 4, 14, 6, 14).permute(1, 3, 0, 2, 4).reshape(24, 3, 14, 14)
    weight = torch.randn(24, 32, dtype=torch.float64)
    grads = {}
    for name, out in (
        ("fast", embed(patches, [(1, 4, 6)])),
        ("naive", naive_patch_embed(frame, embed.proj.weight, embed.proj.bias)),
    ):
        grads[name] = (
            out.detach(),
            *torch.autograd.grad((out * weight).sum(), (frame, *embed.proj.parameters())),
        )
    for fast, naive in zip(grads["fast"], grads["naive"], strict=True):
        assert rel_rms(fast, naive) < 1e-12


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(3, 2, 4), (1, 6, 2), (4, 2, 2)]])
def test_merge_matches_the_naive_loop_forward_and_backward(grids):
    n = sum(t * h * w for t, h, w in grids)
    x = torch.randn(n, 5, dtype=torch.float64, requires_grad=True)
    fast = patch_merge(x, grids, (2, 2))
    (gx_fast,) = torch.autograd.grad((fast * fast.detach().sin()).sum(), x)
    naive = naive_patch_merge(x, grids, (2, 2))
    (gx_naive,) = torch.autograd.grad((naive * naive.detach().sin()).sum(), x)
    assert fast.shape == (sum(h * w // 4 for _, h, w in grids), 4, 5)
    assert torch.equal(fast, naive) and torch.allclose(gx_fast, gx_naive, rtol=0, atol=1e-15)


def test_tokens_are_a_quarter_of_the_patches_and_frames_are_pooled():
    tower = MoonViTV2(load_vision_config(VISION_YAML))
    for grid, tokens in (((1, 2, 2), 1), ((1, 8, 6), 12), ((4, 4, 4), 4), ((2, 10, 2), 5)):
        t, h, w = grid
        out = tower(torch.randn(t * h * w, 3, 14, 14), [grid])
        assert out.shape == (tokens, 4, 32), grid


def test_bad_inputs_name_the_fix():
    tower = MoonViTV2(load_vision_config(VISION_YAML))
    with pytest.raises(ValueError, match="not a multiple of merge_kernel_size"):
        tower(torch.randn(6, 3, 14, 14), [(1, 2, 3)])
    with pytest.raises(ValueError, match="needs 8"):
        tower(torch.randn(6, 3, 14, 14), [(2, 2, 2)])
    with pytest.raises(ValueError, match="at most init_pos_emb_time=4"):
        tower(torch.randn(20, 3, 14, 14), [(5, 2, 2)])
    with pytest.raises(ValueError, match=r"expected \[patches, 3, 14, 14\]"):
        tower(torch.randn(4, 3, 16, 16), [(1, 2, 2)])
    with pytest.raises(ValueError, match="qkv_hidden_size=30 is not a multiple"):
        KimiK3VisionConfig(qkv_hidden_size=30, vt_num_attention_heads=4)
    with pytest.raises(ValueError, match="pos_emb_type='learned'"):
        KimiK3VisionConfig(pos_emb_type="learned")


def test_unknown_preset_key_gets_the_nearest(tmp_path):
    path = tmp_path / "v.yaml"
    path.write_text("vt_hiden_size: 32\n")
    message = r"v.yaml: unknown key 'vt_hiden_size' \(did you mean 'vt_hidden_size'\?\)"
    with pytest.raises(ValueError, match=message):
        load_vision_config(path)
