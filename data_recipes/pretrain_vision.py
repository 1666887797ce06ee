"""Pre-align the tiny MoonViT-V2 of the vision option's SFT: `python -m data_recipes.pretrain_vision`.

K3's MoonViT is pretrained before joint training; ours was not, and the vision SFT stayed at chance
(bench/RESULTS.md): its few hundred visual trajectories give the tower one answer token of gradient
each, too little to learn, from scratch, a feature that tells the language model how many shapes
or which bar. With an oracle in the tower's place (the answer's own token embedding at every visual
position) the same SFT reads the image perfectly within 200 steps, so the language side is not the
bottleneck; the tower is. The SFT then keeps this tower fixed (`train.freeze_vision`): trained at
the text model's lr it loses what it learned here.

This script trains the tower and projector of `stages/models/vision-tiny.yaml` (text width of the
tiny K3 base) to describe drawn scenes: linear heads on the mean of the projected visual tokens
predict what every image shows, whatever question will be asked of it: the kind of picture, the
number of circles and of squares, the digit, each bar's height and which bar is tallest
(`data_recipes.agent_tasks.visual.draw_scene`). The heads are dropped; the tower and projector
are written to `data_recipes/vision_base/` (fp32 safetensors under the released names, the
vision config, the log), which `stages/vision/sft.yaml` names as its `vision:`.

Images come only from `draw_scene`, nothing is downloaded. Their seeds start at 2**32, so no
pretraining image is a prompt's (prompts draw 32-bit seeds). One thread on the CPU and a fixed
seed: the same torch build on the same machine writes the same weights, byte for byte (a test
checks that two short runs agree; the log's timings differ).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save_file
from torch import nn

from data_recipes.shipped import check_shipped_out, logged_arguments, replaced_dir
from posttrain.model.vision_model import VISION_CONFIG_FILE, VISION_PREFIXES, VISION_WEIGHTS_FILE

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "stages" / "models" / "vision-tiny.yaml"
BASE = Path(__file__).resolve().parent / "base"
OUTPUT = Path(__file__).resolve().parent / "vision_base"
LOG_FILE = "pretrain_log.json"
# Seeds of pretraining images: above every 32-bit seed a general/visual prompt draws.
SEED_OFFSET = 2**32
MAX_BARS = 5
KIND_INDEX = {"count": 0, "digit": 1, "bar": 2}  # the kind head's classes

# What a head predicts, and its number of classes.
HEADS = {
    "kind": 3,
    "circle": 10,  # 0 on a picture without shapes; up to 6 asked + 3 distractors
    "square": 10,
    "digit": 11,  # 10: no digit
    "tallest": MAX_BARS + 1,  # 0: not a chart
    **{f"bar{i}": 11 for i in range(MAX_BARS)},  # height in tenths, 0: no such bar
}


def labels(kind: str, scene: dict) -> dict[str, int]:
    """Every head's class for one drawn scene."""
    heights = scene.get("heights", [])
    out = {
        "kind": KIND_INDEX[kind],
        "circle": scene.get("circle", 0),
        "square": scene.get("square", 0),
        "digit": int(scene["digit"]) if "digit" in scene else 10,
        "tallest": heights.index(max(heights)) + 1 if heights else 0,
    }
    out.update({f"bar{i}": heights[i] if i < len(heights) else 0 for i in range(MAX_BARS)})
    return out


def draw_batch(rng: random.Random, size: int) -> tuple[list, dict[str, torch.Tensor]]:
    """`size` scenes, kinds uniform, seeds from `rng` (offset past the prompts' 32-bit seeds)."""
    from data_recipes.agent_tasks.visual import KINDS, draw_scene

    images, rows = [], []
    for _ in range(size):
        kind = rng.choice(KINDS)
        image, _, scene = draw_scene(kind, SEED_OFFSET + rng.getrandbits(40))
        images.append(image)
        rows.append(labels(kind, scene))
    return images, {head: torch.tensor([row[head] for row in rows]) for head in HEADS}


class Describer(nn.Module):
    """Tower + projector + linear heads on the mean projected visual token of each image."""

    def __init__(self, tower: nn.Module, projector: nn.Module, width: int) -> None:
        super().__init__()
        self.vision_tower = tower
        self.mm_projector = projector
        self.heads = nn.ModuleDict({head: nn.Linear(width, n) for head, n in HEADS.items()})

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = self.mm_projector(self.vision_tower(pixel_values, grid_thws))
        kh, kw = self.vision_tower.config.merge_kernel_size
        per_image = [(h // kh) * (w // kw) for _, h, w in grid_thws.tolist()]  # frames are averaged
        pooled = torch.stack([chunk.mean(0) for chunk in tokens.split(per_image)])
        return {head: layer(pooled) for head, layer in self.heads.items()}


def build(seed: int) -> tuple[Describer, object, object]:
    """The describer with the tower and projector initialised as KimiK3ForConditionalGeneration
    initialises fresh ones, under `seed`; the vision config and its processor."""
    from posttrain.model import KimiK3Config
    from posttrain.model.vision_config import load_vision_config
    from posttrain.model.vision_model import KimiK3ForConditionalGeneration, KimiK3VLConfig, image_processor

    text_config = KimiK3Config.from_pretrained(str(BASE))  # the text width the projector maps into
    vision = load_vision_config(PRESET, text_hidden_size=text_config.hidden_size)
    torch.manual_seed(seed)
    # the language model is built and never used: any in-vocabulary placeholder id will do
    config = KimiK3VLConfig(text_config=text_config, vision_config=vision, media_placeholder_token_id=0)
    vl = KimiK3ForConditionalGeneration(config)
    describer = Describer(vl.vision_tower, vl.mm_projector, text_config.hidden_size)
    return describer, vl.config.vision_config, image_processor(vl.config)


def accuracy(model: Describer, processor, images: list, targets: dict[str, torch.Tensor]) -> dict:
    """Held-out accuracy per head (on the images where the head's question applies)."""
    with torch.no_grad():
        batch = processor(images)
        logits = model(batch.pixel_values, batch.grid_thws)
    kind = targets["kind"]
    count, digit, chart = (kind == KIND_INDEX[name] for name in ("count", "digit", "bar"))
    applies = {"kind": torch.ones_like(count), "circle": count, "square": count, "digit": digit}
    out = {}
    for head, value in logits.items():
        hits = (value.argmax(1) == targets[head])[applies.get(head, chart)]
        out[head] = round(float(hits.float().mean()), 4)
    return out


def train(steps: int, batch: int, lr: float, seed: int, log_every: int) -> tuple[Describer, object, dict]:
    """`steps` AdamW steps of `batch` fresh scenes (warm-up, cosine to a tenth, clip 1), one thread;
    (the describer, the vision config, the log with held-out accuracy every `log_every` steps)."""
    torch.set_num_threads(1)
    model, vision_config, processor = build(seed)
    heldout = draw_batch(random.Random(f"vision-align:heldout:{seed}"), 600)
    rng = random.Random(f"vision-align:train:{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:  # linear warm-up, cosine down to a tenth
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    log, started = [], time.time()
    for step in range(1, steps + 1):
        images, targets = draw_batch(rng, batch)
        media = processor(images)
        logits = model(media.pixel_values, media.grid_thws)
        loss = sum(F.cross_entropy(logits[head], targets[head]) for head in HEADS)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % log_every == 0 or step == steps:
            entry = {
                "step": step,
                "loss": round(float(loss.detach()), 4),
                "minutes": round((time.time() - started) / 60, 2),
                "heldout_accuracy": accuracy(model, processor, *heldout),
            }
            log.append(entry)
            print(json.dumps(entry), flush=True)
    return model, vision_config, {"steps": steps, "log": log}


def save(model: Describer, vision_config, log: dict, args: dict, out: Path) -> None:
    """The tower and projector (fp32, released names), the vision config and the log, whole or not
    at all (written to a sibling directory, then renamed into place)."""
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if name.startswith(VISION_PREFIXES)
    }
    keys = yaml.safe_load(PRESET.read_text())
    keys["text_hidden_size"] = vision_config.text_hidden_size
    with replaced_dir(out) as tmp:
        save_file(state, str(tmp / VISION_WEIGHTS_FILE))
        (tmp / VISION_CONFIG_FILE).write_text(yaml.safe_dump(keys, sort_keys=False))
        (tmp / LOG_FILE).write_text(json.dumps({"args": args, **log}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=500)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args()
    recorded = {k: v for k, v in vars(args).items() if k != "out"}
    made_by = logged_arguments(OUTPUT / LOG_FILE)
    check_shipped_out(parser, args.out, OUTPUT, recorded, {k: made_by.get(k) for k in recorded})
    model, vision_config, log = train(args.steps, args.batch, args.lr, args.seed, args.log_every)
    save(model, vision_config, log, recorded, args.out)


if __name__ == "__main__":
    main()
