"""Rollout and scoring engines: one interface (`Engine`), an embedded backend (our model, this
process) and vLLM backends (in-process, an OpenAI-compatible server, a `trl vllm-serve` fleet).

vLLM is an optional dependency: its engines live in `posttrain.engines.vllm_engine`,
`posttrain.engines.vllm_server` and `posttrain.engines.trl_client`, each importable without vLLM
and failing with the install command only when an engine is built.
"""

from posttrain.engines.base import ENGINES, Engine, EngineError, SamplingConfig
from posttrain.engines.embedded import EmbeddedEngine

__all__ = ["ENGINES", "EmbeddedEngine", "Engine", "EngineError", "SamplingConfig"]
