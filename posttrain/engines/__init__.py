"""Rollout and scoring engines: one interface (`Engine`), an embedded backend (our model, this
process) and vLLM backends (in-process, an OpenAI-compatible server, a `trl vllm-serve` fleet).

Every backend registers in `ENGINES` by name ("embedded", "vllm", "vllm_server", "trl_vllm").
vLLM is an optional dependency: importing this package never imports it; building a vLLM engine
without it fails with the install command.
"""

from posttrain.engines.base import ENGINES, Engine, EngineError, SamplingConfig
from posttrain.engines.embedded import EmbeddedEngine
from posttrain.engines.trl_client import TRLVLLMClient
from posttrain.engines.vllm_engine import VLLMEngine
from posttrain.engines.vllm_server import VLLMServer, VLLMServerEngine

__all__ = [
    "ENGINES",
    "EmbeddedEngine",
    "Engine",
    "EngineError",
    "SamplingConfig",
    "TRLVLLMClient",
    "VLLMEngine",
    "VLLMServer",
    "VLLMServerEngine",
]
