"""One way to turn (engine name, checkpoint) into an `Engine`, for RL rollouts and MOPD teachers.

A stage file names an engine by its `ENGINES` name; both the `rl` stage (`rollout.engine`, when
the rollouts are not the trained module itself) and the `mopd` stage (`teacher_engine`,
`teachers.<pair>.engine`) build it here, so a backend is added once and every stage can select it:
  embedded     the checkpoint in this process (our K3 with the QAT its training recorded, or any
               transformers causal LM), eval mode;
  vllm         `vllm.LLM` in this process;
  vllm_server  vLLM's OpenAI-compatible server as a subprocess on a free port, restarted if it dies;
  trl_vllm     a `trl vllm-serve` server someone already runs, at `url` (TRL's own client);
  any other    a plug-in's Engine class registered in ENGINES, built as cls(model_dir).
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.engines.base import ENGINES, Engine, LogprobsMode
from posttrain.engines.embedded import EmbeddedEngine
from posttrain.engines.trl_client import TRLVLLMClient

SERVED = ("vllm", "vllm_server", "trl_vllm")  # engines that hold their own copy of the weights


def build_engine(
    name: str,
    model_dir: Path,
    *,
    work_dir: Path,
    log_name: str,
    seed: int = 0,
    logprobs_mode: LogprobsMode = "raw",
    url: str | None = None,
    device: torch.device | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> Engine:
    """The `name` engine serving `model_dir`. work_dir/log_name*: the vLLM server's log, the TRL
    client's weight directory. seed and logprobs_mode reach the vllm and vllm_server engines; url
    is trl_vllm's. device and autocast_dtype are the embedded engine's: on a GPU its weights are
    held in autocast_dtype (it only samples and scores, as a vLLM server would hold them) and its
    forwards autocast to it."""
    engine_class = ENGINES.get(name)  # an unknown name fails here with the registered ones
    if name == "embedded":
        from posttrain.qat import restore_qat

        engine = EmbeddedEngine.from_pretrained(model_dir, autocast_dtype=autocast_dtype)
        if device is not None and device.type == "cuda":
            engine.model.to(device=device, dtype=autocast_dtype)
        restore_qat(engine.model)
        engine.model.eval()
        return engine
    if name == "vllm":
        from posttrain.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, seed=seed, logprobs_mode=logprobs_mode)
    if name == "vllm_server":
        from posttrain.engines.vllm_server import VLLMServer, VLLMServerEngine

        log = Path(work_dir) / f"{log_name}.log"
        return VLLMServerEngine(VLLMServer(model=model_dir, logprobs_mode=logprobs_mode, log_path=log))
    if name == "trl_vllm":
        if not url:
            raise ValueError(
                f"engine trl_vllm for {model_dir} needs the url of the `trl vllm-serve` server that serves it"
            )
        # trl vllm-serve records processed log-probs (its --logprobs-mode processed_logprobs)
        return TRLVLLMClient(url, weights_dir=Path(work_dir) / f"{log_name}-weights")
    return engine_class(model_dir)
