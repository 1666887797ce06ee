"""Peak anonymous memory of loading a K3 directory, run in a fresh process; prints one JSON line:

    python tests/interchange/load_memory_check.py MODEL_DIR streamed|naive

`streamed` is `from_pretrained` (meta-device build, tensors streamed from the safetensors shards);
`naive` builds the model with its random initialisation and then reads a full state dict in the
model's shapes (per-expert tensors stacked into the 3-D expert weights, as a converting loader
must), the two-copies way a loader must not work. A sampling thread reads RssAnon from /proc/self/status
every millisecond: anonymous memory only, because the shards themselves are memory-mapped files
whose pages the kernel can drop.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = rss_anon()
        self.running = True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)


def main(model_dir: Path, how: str) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    import posttrain.model  # noqa: F401

    config = AutoConfig.from_pretrained(str(model_dir))
    files = sorted(model_dir.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    before = rss_anon()
    sampler = PeakSampler()
    sampler.start()
    if how == "streamed":
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        flat = {}
        for file in files:
            flat.update(load_file(str(file)))
        experts: dict[str, list] = {}
        for name in sorted(flat, key=lambda n: (n.rsplit(".experts.", 1)[0], n)):
            if ".experts." in name:
                module, rest = name.rsplit(".experts.", 1)
                index, w, _ = rest.split(".", 2)
                experts.setdefault(f"{module}.experts.{w}", []).append((int(index), flat[name]))
        state = {k: torch.stack([t for _, t in sorted(v, key=lambda x: x[0])]) for k, v in experts.items()}
        del state, flat
    sampler.running = False
    sampler.join()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"file_bytes": size, "param_bytes": params, "peak_delta": max(sampler.peak, rss_anon()) - before}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(Path(sys.argv[1]), sys.argv[2])))
